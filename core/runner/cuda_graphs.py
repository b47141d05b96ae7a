"""CUDA graphs of the pure-decode forward (docs/ARCHITECTURE.md): one per batch size of a ladder, replayed with padding.

A decode step of a few hundred sequences is hundreds of small kernels; replaying a captured graph removes their
launch cost. The graphs read the step's inputs from the runner's fixed device buffers (`StepBuffers`), so a
replay needs no copies; the runner pads a batch to the next captured size with entries that write no KV. A graph
also applies the step's block-table updates (one entry per row, padded with writes to the sink row) and gathers
the rows' tables, so a decode step costs the host no launch but the replay's."""
from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.distributed import before_tp_group_destroyed, tp_size
from nanovllm.runner.inputs import StepInputs
from nanovllm.runner.persistent_batch import DeviceBlockTables
from nanovllm.runner.step_buffers import buffer_specs

# The step inputs a decode graph reads; a tensor-parallel worker, which receives them elsewhere, copies them in.
_GRAPH_FIELDS = [name for name, f in buffer_specs(StepInputs) if f.metadata["graph"]]


def batch_size_ladder(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, every multiple of 16 up to 256, then every multiple of 64: padding wastes at most 15 rows up
    to 256 and under 1/4 of a row in every 4 beyond, and a batch of 1,024 needs 32 graphs, not 68 (each capture
    costs start-up time)."""
    sizes = ([s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, min(max_batch_size, 256), 16))
             + list(range(256, max_batch_size, 64)))
    return sorted(set(sizes + [max_batch_size]))


class DecodeGraphs:
    def __init__(self, model, inputs_for: Callable[[int], StepInputs], tables: DeviceBlockTables,
                 max_batch_size: int, max_seq_len: int, block_size: int, num_groups: int):
        self.sizes = batch_size_ladder(max_batch_size)
        largest = inputs_for(max_batch_size)
        # The block tables a replay reads, per KV group: full width, since a graph is captured once for every
        # context length.
        self.block_tables = torch.zeros(num_groups, max_batch_size, -(-max_seq_len // block_size),
                                        dtype=torch.int32, device=largest.input_ids.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepInputs, torch.Tensor]] = {}
        # Safe contents while capturing: one token per row, no KV written, row 0's table (all zeros yet).
        largest.input_ids.zero_()
        largest.positions.zero_()
        largest.slot_mapping.fill_(-1)
        largest.seq_lens.fill_(1)
        largest.rows.zero_()
        largest.query_start_loc.copy_(torch.arange(max_batch_size + 1, dtype=torch.int32))
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
                inputs = inputs_for(size)
                meta = AttentionMetadata.grouped(
                    slot_mapping=inputs.slot_mapping, block_tables=self.block_tables[:, :size],
                    query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens, max_query_len=1,
                    max_seq_len=max_seq_len, decode_num_splits=inputs.decode_num_splits)
                inputs.table_updates[0].fill_(tables.sink_index)
                inputs.table_updates[1].zero_()
                _decode_step(model, tables, inputs, meta, self.block_tables[:, :size])  # compile, initialise
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = _decode_step(model, tables, inputs, meta, self.block_tables[:, :size])
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
        if inputs is not None and inputs.input_ids.data_ptr() != captured.input_ids.data_ptr():  # all or none
            for name in _GRAPH_FIELDS:
                getattr(captured, name).copy_(getattr(inputs, name))
        graph.replay()
        return logits


def _decode_step(model, tables: DeviceBlockTables, inputs: StepInputs, meta: AttentionMetadata,
                 block_tables: torch.Tensor) -> torch.Tensor:
    """What a graph runs: apply the table updates, gather the rows' tables (per KV group, into `block_tables`,
    which `meta` reads), forward, logits."""
    tables.apply(inputs.table_updates)
    tables.gather_groups(inputs.rows, len(block_tables), out=block_tables)
    return model.compute_logits(model(inputs.input_ids, inputs.positions, meta))
