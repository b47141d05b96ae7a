"""CUDA graphs of the pure-decode forward (DESIGN §6): one per batch size of a ladder, replayed with padding.

A decode step of a few hundred sequences is hundreds of small kernels; replaying a captured graph removes their
launch cost. The graphs read the step's inputs from the runner's fixed device buffers (`StepBuffers`), so a
replay needs no copies; the runner pads a batch to the next captured size with entries that write no KV. A graph
also applies the step's block-table updates (one entry per row, padded with writes to the sink row) and gathers
the rows' tables, so a decode step costs the host no launch but the replay's."""
from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.distributed import before_tp_group_destroyed, tp_size
from nanovllm.engine.step_buffers import DeviceBlockTables

if TYPE_CHECKING:
    from nanovllm.engine.model_runner import StepInputs


def batch_size_ladder(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16: padding wastes at most 15 rows where batches are large."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


class DecodeGraphs:
    def __init__(self, model, buffers: dict[str, torch.Tensor], tables: DeviceBlockTables, max_batch_size: int,
                 max_seq_len: int, block_size: int, num_splits_for: Callable[[int], int]):
        self.sizes = batch_size_ladder(max_batch_size)
        # The block tables a replay reads: full width, since a graph is captured once for every context length.
        self.block_tables = torch.zeros(max_batch_size, -(-max_seq_len // block_size), dtype=torch.int32,
                                        device=buffers["input_ids"].device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        # Safe contents while capturing: one token per row, no KV written, row 0's table (all zeros yet).
        buffers["input_ids"].zero_()
        buffers["positions"].zero_()
        buffers["slot_mapping"].fill_(-1)
        buffers["seq_lens"].fill_(1)
        buffers["rows"].zero_()
        buffers["query_start_loc"].copy_(torch.arange(len(buffers["query_start_loc"]), dtype=torch.int32))
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
                meta = AttentionMetadata(
                    slot_mapping=buffers["slot_mapping"][:size],
                    query_start_loc=buffers["query_start_loc"][:size + 1],
                    seq_lens=buffers["seq_lens"][:size],
                    block_tables=self.block_tables[:size],
                    max_query_len=1,
                    max_seq_len=max_seq_len,
                    decode_num_splits=num_splits_for(size),
                )
                updates = buffers["table_updates"][:2 * size].view(2, size)
                updates[0].fill_(tables.sink_index)
                updates[1].zero_()
                inputs = (buffers["input_ids"][:size], buffers["positions"][:size], meta.slot_mapping,
                          meta.seq_lens, buffers["rows"][:size], updates)
                _decode_step(model, tables, inputs, meta)  # compile and initialise outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = _decode_step(model, tables, inputs, meta)
                pool = graph.pool()
                self.graphs[size] = (graph, inputs, logits)
        torch.cuda.synchronize()
        if tp_size() > 1:  # the graphs hold the model's collectives
            before_tp_group_destroyed(self.release)

    def release(self) -> None:
        """Free every graph (the engine is done with them)."""
        torch.cuda.synchronize()
        self.graphs.clear()

    def batch_size_for(self, num_seqs: int) -> int | None:
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def replay(self, size: int, inputs: StepInputs | None = None) -> torch.Tensor:
        """Run the graph of `size` on these StepInputs (None: on what the captured buffers hold). The runner
        prepares them in the captured buffers already; a tensor-parallel worker receives them elsewhere and they
        are copied in."""
        graph, captured, logits = self.graphs[size]
        if inputs is not None and inputs.input_ids.data_ptr() != captured[0].data_ptr():  # all in place, or none
            for source, target in zip((inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens,
                                       inputs.rows, inputs.table_updates), captured):
                target.copy_(source)
        graph.replay()
        return logits


def _decode_step(model, tables: DeviceBlockTables, inputs: tuple[torch.Tensor, ...],
                 meta: AttentionMetadata) -> torch.Tensor:
    """What a graph runs: apply the table updates, gather the rows' tables, forward, logits."""
    input_ids, positions, _, _, rows, updates = inputs
    tables.apply(updates)
    tables.gather(rows, out=meta.block_tables)
    return model.compute_logits(model(input_ids, positions, meta))
