"""The incremental device block tables and the fixed-offset step buffers (CPU)."""
import numpy as np
import torch
from helpers import make_seq

from nanovllm.engine.cuda_graphs import batch_size_ladder
from nanovllm.engine.sequence import SequenceStatus
from nanovllm.engine.step_buffers import DeviceBlockTables, Field, StepBuffers


def rows_of(tables: DeviceBlockTables, seqs) -> torch.Tensor:
    rows, updates = tables.sync(seqs)
    tables.apply(updates)
    return tables.table[rows]


def test_block_tables_send_only_new_entries_and_resync_after_preemption():
    tables = DeviceBlockTables(max_rows=4, max_blocks_per_seq=6, device=torch.device("cpu"))
    a, b = make_seq([1] * 40), make_seq([2] * 10)
    for seq in (a, b):
        seq.status = SequenceStatus.RUNNING
    a.block_table, b.block_table = [7, 3, 9], [5]
    assert rows_of(tables, [a, b])[:, :3].tolist() == [[7, 3, 9], [5, 0, 0]]
    a.block_table.append(11)
    rows, updates = tables.sync([a, b])
    assert updates == [rows[0], 3, 11]  # one (row, column, block) triple: the appended block only
    tables.apply(updates)
    a.block_table, a.epoch = [2, 4], a.epoch + 1  # preempted and readmitted: a new table, all of it re-sent
    rows, updates = tables.sync([a])
    assert updates == [rows[0], 0, 2, rows[0], 1, 4]


def test_rows_of_stopped_sequences_are_reclaimed():
    tables = DeviceBlockTables(max_rows=2, max_blocks_per_seq=2, device=torch.device("cpu"))
    first = [make_seq([1]), make_seq([2])]
    for seq in first:
        seq.status, seq.block_table = SequenceStatus.RUNNING, [1]
    tables.sync(first)
    first[0].status = SequenceStatus.FINISHED
    late = make_seq([3])
    late.status, late.block_table = SequenceStatus.RUNNING, [8]
    rows, _ = tables.sync([first[1], late])
    assert len(set(rows)) == 2 and tables.padding_row == 2


def test_step_buffers_round_trip_typed_fields():
    buffers = StepBuffers([Field("ids", torch.int64, 5), Field("lens", torch.int32, 3),
                           Field("temps", torch.float32, 3)], torch.device("cpu"))
    host = buffers.begin()
    host["ids"][:] = [1, 2, 3, 4, 5]
    host["lens"][:] = [7, 8, 9]
    host["temps"][:] = [0.5, 1.0, 0.0]
    buffers.upload()
    device = buffers.on_device
    assert device["ids"].tolist() == [1, 2, 3, 4, 5] and device["lens"].dtype == torch.int32
    assert device["lens"].tolist() == [7, 8, 9]
    assert np.allclose(device["temps"].numpy(), [0.5, 1.0, 0.0])


def test_graph_ladder_covers_every_batch_size():
    ladder = batch_size_ladder(100)
    assert ladder[:4] == [1, 2, 4, 8] and ladder[-1] == 100
    assert all(b - a <= 16 for a, b in zip(ladder, ladder[1:]))
