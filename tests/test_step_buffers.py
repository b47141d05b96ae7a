"""The per-sequence rows (incremental block tables, per-row settings) and the fixed-offset step buffers (CPU)."""
import numpy as np
import pytest
import torch
from helpers import make_seq

from nanovllm.runner.cuda_graphs import batch_size_ladder
from nanovllm.runner.persistent_batch import DeviceBlockTables, SequenceRows
from nanovllm.runner.step_buffers import Field, StepBuffers

VOCAB = 100


def sync(rows: SequenceRows, seqs, tables: DeviceBlockTables | None = None
         ) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Rows of `seqs` after a sync of all of them (applied to `tables`, if given), and the (row, column, block)
    entries it reported missing on the device."""
    indices, blocks = rows.sync(seqs)
    if tables is not None:
        tables.apply(torch.tensor([indices, blocks], dtype=torch.int32).view(2, -1))
    sent = [(i // rows.width, i % rows.width, b) for i, b in zip(indices, blocks)]
    return [rows.row_of[seq.seq_id] for seq in seqs], sent


def test_tables_send_only_new_entries_and_resync_after_preemption():
    rows = SequenceRows(max_rows=4, max_blocks_per_seq=6, vocab_size=VOCAB)
    tables = DeviceBlockTables(len(rows.host_tables), rows.width, torch.device("cpu"))
    a, b = make_seq([1] * 40), make_seq([2] * 10)
    a.block_table, b.block_table = [7, 3, 9], [5]
    ids, _ = sync(rows, [a, b], tables)
    assert tables.gather(torch.tensor(ids), 3).tolist() == [[7, 3, 9], [5, 0, 0]]
    a.block_table.append(11)
    ids, sent = sync(rows, [a, b], tables)
    assert sent == [(ids[0], 3, 11)]  # the appended block only
    a.block_table, a.epoch = [2, 4], a.epoch + 1  # preempted and readmitted: a new table, all of it re-sent
    ids, sent = sync(rows, [a], tables)
    assert sent == [(ids[0], 0, 2), (ids[0], 1, 4)]
    assert tables.tables[ids[0], :2].tolist() == [2, 4]
    # the host mirror agrees, and the device's extra sink row took nothing
    assert np.array_equal(rows.host_tables, tables.tables[:-1].numpy()) and not tables.tables[-1].any()


def test_group_tables_split_the_interleaved_rows():
    """A row interleaves its KV groups' tables (kv_groups.py); each group's table comes out contiguous, cut to a
    number of blocks, or into a fixed buffer as a decode graph gathers them."""
    tables = DeviceBlockTables(num_rows=2, width=6, device=torch.device("cpu"))
    tables.tables[0] = torch.tensor([10, 20, 11, 21, 12, 22])  # group 0: 10, 11, 12; group 1: 20, 21, 22
    tables.tables[1] = torch.tensor([30, 40, 31, 41, 0, 0])
    rows = torch.tensor([1, 0])
    by_group = tables.gather_groups(rows, 2, num_blocks=2)
    assert by_group.tolist() == [[[30, 31], [10, 11]], [[40, 41], [20, 21]]] and by_group[1].is_contiguous()
    out = torch.full((2, 4, 3), -5, dtype=torch.int32)
    tables.gather_groups(rows, 2, out=out[:, :2])
    assert out[:, :2].tolist() == [[[30, 31, 0], [10, 11, 12]], [[40, 41, 0], [20, 21, 22]]]
    assert (out[:, 2:] == -5).all()
    one = torch.zeros(1, 2, 6, dtype=torch.int32)
    tables.gather_groups(rows, 1, out=one)  # one group: the rows as they are
    assert one[0].tolist() == [tables.tables[1].tolist(), tables.tables[0].tolist()]
    assert tables.gather_groups(rows, 1, num_blocks=3).tolist() == [[[30, 40, 31], [10, 20, 11]]]


def test_padding_updates_land_in_the_sink_row_only():
    """A graph step applies a fixed number of entries: the padding ones write the sink row, which no row reads."""
    tables = DeviceBlockTables(num_rows=3, width=4, device=torch.device("cpu"))
    sink = tables.sink_index
    tables.apply(torch.tensor([[1 * 4 + 2, sink, sink], [9, 0, 0]], dtype=torch.int32))
    assert tables.gather(torch.tensor([0, 1, 2])).tolist() == [[0] * 4, [0, 0, 9, 0], [0] * 4]
    assert sink == 3 * 4


def test_rows_hold_sampling_settings_and_refresh_them_on_a_new_epoch():
    rows = SequenceRows(max_rows=2, max_blocks_per_seq=2, vocab_size=VOCAB)
    seq = make_seq([1, 2, 3], temperature=0.5, top_k=0, top_p=0.9, min_p=0.1)
    seq.block_table, seq.num_shared_kv_tokens = [1], 0
    (row,), _ = sync(rows, [seq])
    assert (rows.temperature[row], rows.top_k[row], rows.top_p[row], rows.min_p[row]) == (
        np.float32(0.5), VOCAB, np.float32(0.9), np.float32(0.1))
    assert rows.num_prompt_tokens[row] == 3 and rows.seed[row] == seq.sampling_seed
    seq.num_shared_kv_tokens, seq.epoch = 16, seq.epoch + 1  # readmitted onto prefix-cache hits
    (row,), _ = sync(rows, [seq])
    assert rows.num_shared_kv_tokens[row] == 16


def test_rows_of_released_sequences_are_reused():
    rows = SequenceRows(max_rows=2, max_blocks_per_seq=2, vocab_size=VOCAB)
    first = [make_seq([1]), make_seq([2])]
    for seq in first:
        seq.block_table = [1]
    (freed, _), _ = sync(rows, first)
    late = make_seq([3])
    late.block_table = [8]
    with pytest.raises(RuntimeError, match="more running sequences than rows"):
        sync(rows, [late])
    rows.release([first[0].seq_id])
    ids, sent = sync(rows, [first[1], late])
    assert ids[1] == freed and sent == [(freed, 0, 8)] and rows.padding_row == 2
    assert first[0].seq_id not in rows.row_of


def test_step_buffers_round_trip_typed_fields():
    buffers = StepBuffers([Field("ids", torch.int64, 5), Field("lens", torch.int32, 3),
                           Field("temps", torch.float32, 3)], torch.device("cpu"))
    host = buffers.begin()
    host["ids"][:] = [1, 2, 3, 4, 5]
    host["lens"][:] = [7, 8, 9]
    host["temps"][:] = [0.5, 1.0, 0.0]
    buffers.upload(3)
    device = buffers.on_device
    assert device["ids"].tolist() == [1, 2, 3, 4, 5] and device["lens"].dtype == torch.int32
    assert device["lens"].tolist() == [7, 8, 9]
    assert np.allclose(device["temps"].numpy(), [0.5, 1.0, 0.0])


def test_graph_ladder_covers_every_batch_size():
    ladder = batch_size_ladder(100)
    assert ladder[:4] == [1, 2, 4, 8] and ladder[-1] == 100
    assert all(b - a <= 16 for a, b in zip(ladder, ladder[1:]))


@pytest.mark.gpu
def test_upload_copies_only_the_used_part_of_the_last_field():
    buffers = StepBuffers([Field("ids", torch.int64, 4), Field("tail", torch.int32, 8)], torch.device("cuda"))
    for round_ in range(3):  # both pinned host buffers, and a device buffer that already holds older steps
        host = buffers.begin()
        host["ids"][:] = [round_] * 4
        host["tail"][:] = np.arange(8) + 10 * round_
        buffers.upload(3 if round_ else 8)
    torch.cuda.synchronize()
    assert buffers.on_device["ids"].tolist() == [2] * 4
    assert buffers.on_device["tail"].tolist() == [20, 21, 22, 3, 4, 5, 6, 7]
