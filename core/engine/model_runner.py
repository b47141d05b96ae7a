from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention import AttentionMetadata, select_backend
from nanovllm.config import EngineConfig
from nanovllm.distributed import min_over_ranks
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.step_buffers import DeviceBlockTables, Field, SequenceRows, StepBuffers
from nanovllm.layers.sampler import SamplingTensors, sample
from nanovllm.loaders import ResolvedModel, load_dummy_weights, load_safetensors_weights
from nanovllm.models.llama import head_dim_of, kv_block_bytes, kv_heads_per_rank
from nanovllm.models.registry import model_class_for


@dataclass
class StepInputs:
    """One step's device inputs; every tensor-parallel rank executes the same ones (tp_step.py sends them)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    rows: torch.Tensor  # each sequence's row of the block tables
    table_updates: torch.Tensor  # [2, n] table entries new to the device (flat indices, block ids), applied first
    logits_indices: torch.Tensor  # the last new token of each sequence
    sampling: SamplingTensors
    max_query_len: int
    max_seq_len: int
    decode_num_splits: int
    graph_size: int | None  # replay the decode graph of this batch size instead of running eagerly


@dataclass(frozen=True)
class _DeviceViews:
    """Slices of the step buffers' device views for one step size (see ModelRunner._slice_device_views)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    rows: torch.Tensor
    decode_input_ids: torch.Tensor  # one per sequence, padding excluded: where a steady decode's inputs go
    logits_indices: torch.Tensor
    temperatures: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    sample_positions: torch.Tensor


@dataclass
class _OutputSlot:
    """Pinned host memory for one step's sampled ids, and that step's events; reused every other step."""

    host: torch.Tensor
    timing: tuple[torch.cuda.Event, torch.cuda.Event]
    ready: torch.cuda.Event


@dataclass
class StepHandle:
    """A launched step: sampled ids on the device, their pinned host copy, timing events, the copy's event, and
    the number of the step-buffer upload the step read."""

    sampled: torch.Tensor
    host: torch.Tensor | None
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None
    ready: torch.cuda.Event | None
    upload: int


class ModelRunner:
    """Executes scheduled batches: builds the model, owns the KV cache, prepares inputs, runs forward + sampling."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int):
        self.config = config
        self.hf_config = resolved.hf_config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.vocab_size = self.hf_config.vocab_size
        self.num_kv_heads = kv_heads_per_rank(self.hf_config)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class_for(self.hf_config)(self.hf_config,
                                                             fused_ops=config.fused_ops and self.device.type == "cuda")
        finally:
            torch.set_default_dtype(default_dtype)
        if resolved.weights_dir is None:
            load_dummy_weights(self.model, seed=config.seed)
        else:
            load_safetensors_weights(self.model, resolved.weights_dir)
        self.model.eval()

        self.num_kv_blocks = config.num_kv_blocks or min_over_ranks(self._kv_budget_blocks())  # TP: fits every rank
        capacity = self.num_kv_blocks * self.block_size
        if capacity < max_model_len:  # checked before anything (CUDA graphs included) touches the cache
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks} blocks = {capacity} tokens, less than one sequence of "
                f"max_model_len={max_model_len}: lower max_model_len, or raise gpu_memory_utilization / "
                "num_kv_blocks (cpu_kv_cache_bytes on the CPU); gpu_memory_utilization counts all memory in use "
                "on the device, other engines' included")
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        backend = select_backend(config.attention_backend, self.device)
        if self.block_size % backend.required_block_size_multiple:
            raise ValueError(f"the {backend.name} attention backend needs a block_size divisible by "
                             f"{backend.required_block_size_multiple}; got block_size={self.block_size}")
        self.backend = backend
        for index, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = self.kv_cache[0, index], self.kv_cache[1, index]
            layer.backend = backend
        self.attention_backend = backend.name

        self.max_batch_size = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.buffers = StepBuffers(self._step_fields(), self.device)
        # Rows for twice the running sequences: finished ones are reclaimed in bulk, rarely.
        self.rows = SequenceRows(2 * self.max_batch_size, self.max_blocks_per_seq, self.vocab_size)
        self.tables = DeviceBlockTables(len(self.rows.host_tables), self.max_blocks_per_seq, self.device)
        self._device_views = functools.lru_cache(maxsize=4096)(self._slice_device_views)
        self._placeholder_views = functools.lru_cache(maxsize=1024)(self._slice_placeholder_views)
        self._table_update_views = functools.lru_cache(maxsize=4096)(self._slice_table_update_views)
        self._rows_of: tuple[list, np.ndarray] = ([], np.zeros(0, dtype=np.int64))  # a batch's seqs, their rows
        self._arange = np.arange(self.max_batch_size + 1)
        if self.device.type == "cuda":
            self._output_slots = [
                _OutputSlot(torch.empty(self.max_batch_size, dtype=torch.int64, pin_memory=True),
                            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)),
                            torch.cuda.Event())
                for _ in range(2)]
            self._next_slot = 0
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and backend.supports_cuda_graphs:
            self.graphs = DecodeGraphs(self.model, self.buffers.on_device, self.tables, self.max_batch_size,
                                       max_model_len, self.block_size,
                                       lambda size: backend.decode_num_splits(size, max_model_len, self.num_kv_heads))

    # ---- KV cache --------------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.hf_config, self.block_size, self.dtype.itemsize, self.num_kv_heads)

    def _kv_budget_blocks(self) -> int:
        if self.device.type == "cpu":
            return self.config.cpu_kv_cache_bytes // self.kv_block_bytes
        return self._profile_gpu_kv_blocks()

    def _profile_gpu_kv_blocks(self) -> int:
        """DESIGN §3: warm up at the largest token batch, then give the cache what the memory budget leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup_forward()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free
        peak_activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.gpu_memory_utilization - in_use - peak_activations
        torch.cuda.empty_cache()
        return max(int(budget) // self.kv_block_bytes, 0)

    @torch.inference_mode()
    def _warmup_forward(self) -> None:
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_num_seqs * self.max_model_len)
        num_seqs = max(min(self.config.max_num_seqs, num_tokens // self.max_model_len), 1)
        # A one-block scratch cache with every write skipped and every table entry pointing at it: the forward
        # has real shapes and reads valid memory, but touches no real KV.
        scratch = self._allocate_kv_cache(1)
        for index, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = scratch[0, index], scratch[1, index]
            layer.backend = select_backend(self.config.attention_backend, self.device)
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        starts = torch.tensor([0] + lens, device=self.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=starts,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(num_seqs, -(-max(lens) // self.block_size), dtype=torch.int32,
                                     device=self.device),
            max_query_len=max(lens), max_seq_len=max(lens),
        )
        hidden = self.model(ids, positions, meta)
        self.model.compute_logits(hidden[starts[1:] - 1])

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        hf = self.hf_config
        shape = (2, hf.num_hidden_layers, num_blocks, self.block_size, kv_heads_per_rank(hf), head_dim_of(hf))
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    # ---- one step ----------------------------------------------------------------------------------------------

    def _step_fields(self) -> list[Field]:
        max_tokens, max_seqs = self.config.max_num_batched_tokens, self.max_batch_size
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        return [
            Field("input_ids", i64, max_tokens), Field("positions", i64, max_tokens),
            Field("slot_mapping", i64, max_tokens), Field("query_start_loc", i32, max_seqs + 1),
            Field("seq_lens", i32, max_seqs), Field("rows", i64, max_seqs), Field("logits_indices", i64, max_seqs),
            Field("placeholder_rows", i64, max_seqs), Field("placeholder_sources", i64, max_seqs),
            Field("temperatures", f32, max_seqs), Field("top_k", i64, max_seqs), Field("top_p", f32, max_seqs),
            Field("min_p", f32, max_seqs), Field("seeds", i64, max_seqs), Field("sample_positions", i64, max_seqs),
            # Last, because it is uploaded only as far as it is used: block-table entries new to the device
            # (n flat indices, then n block ids); at most every table of a full batch.
            Field("table_updates", i32, 2 * max_seqs * self.max_blocks_per_seq),
        ]

    def prepare(self, batch: ScheduledBatch, previous: StepHandle | None = None) -> StepInputs:
        """Device inputs for `batch`. An input that `previous` (the step launched before, which may still be
        running) samples is gathered on the device from that step's output: a position past a sequence's known
        tokens, or every input of a batch that is `previous` one position further on.

        Per sequence, only the row lookup is Python work; everything else is vectorised over the batch from the
        sequences' rows (block tables, sampling settings) and the batch's own lists."""
        seqs = batch.seqs
        num_seqs = len(seqs)
        host = self.buffers.begin()
        update_indices, update_blocks = self.rows.sync(batch.table_changed)
        num_updates = len(update_blocks)
        if seqs is not self._rows_of[0]:  # the scheduler's steady decode steps reuse one list of sequences
            self._rows_of = (seqs, np.fromiter([seq.row for seq in seqs], np.int64, num_seqs))
        input_ids = batch.input_ids
        num_tokens = len(input_ids)
        pure_decode = num_tokens == num_seqs
        graph_size = self.graphs.batch_size_for(num_seqs) if self.graphs and pure_decode else None
        if graph_size is not None and num_updates > graph_size:
            graph_size = None  # a graph applies one table entry per row; a readmitted sequence may bring more
        padded_seqs = graph_size or num_seqs
        # Table entries the step carries: a graph's fixed number (padded with writes to the sink row), or all.
        num_staged = graph_size or num_updates
        staged = host["table_updates"]
        staged[:num_updates] = update_indices
        staged[num_staged:num_staged + num_updates] = update_blocks
        if num_staged > num_updates:
            staged[num_updates:num_staged] = self.tables.sink_index
            staged[num_staged + num_updates:2 * num_staged] = 0

        host_rows = host["rows"][:padded_seqs]
        host_rows[:num_seqs] = self._rows_of[1]
        host_rows[num_seqs:] = self.rows.padding_row
        rows = host_rows[:num_seqs]
        starts = np.array(batch.start_positions, dtype=np.int64)
        query_start = host["query_start_loc"][:num_seqs + 1]
        if pure_decode:
            query_start[:] = self._arange[:num_seqs + 1]
            positions, token_rows, ends = starts, rows, starts + 1
        else:
            num_new = np.array(batch.num_new_tokens, dtype=np.int64)
            query_start[0] = 0
            np.cumsum(num_new, out=query_start[1:])
            positions = np.arange(num_tokens) + np.repeat(starts - query_start[:-1], num_new)
            token_rows = np.repeat(rows, num_new)
            ends = starts + num_new
        block_size = self.block_size
        slots = host["slot_mapping"][:num_tokens]
        np.add(self.rows.host_tables[token_rows, positions // block_size] * block_size, positions % block_size,
               out=slots)
        slots[positions < self.rows.num_shared_kv_tokens[token_rows]] = -1  # complete shared blocks: no write
        copy_previous_samples = batch.inputs_are_previous_samples
        num_placeholders = 0 if copy_previous_samples else batch.num_placeholders
        if not copy_previous_samples:
            host["input_ids"][:num_tokens] = input_ids
        host["positions"][:num_tokens] = positions
        host["seq_lens"][:num_seqs] = ends
        np.subtract(query_start[1:], 1, out=host["logits_indices"][:num_seqs])
        if padded_seqs > num_seqs:  # graph padding: one token each, no KV written, the all-zero table row
            pad = slice(num_seqs, padded_seqs)
            host["input_ids"][pad] = 0
            host["positions"][pad] = 0
            host["slot_mapping"][pad] = -1
            host["query_start_loc"][num_seqs + 1:padded_seqs + 1] = self._arange[num_tokens + 1:padded_seqs + 1]
            host["seq_lens"][pad] = 1
        if num_placeholders:
            sources = np.array(batch.placeholder_sources, dtype=np.int64)
            placeholders = np.flatnonzero(sources >= 0)
            host["placeholder_rows"][:num_placeholders] = query_start[placeholders + 1] - 1
            host["placeholder_sources"][:num_placeholders] = sources[placeholders]
        temperatures = host["temperatures"][:num_seqs]
        np.take(self.rows.temperature, rows, out=temperatures)
        all_greedy = not temperatures.any()
        any_filter = False
        if not all_greedy:
            for name, values in (("top_k", self.rows.top_k), ("top_p", self.rows.top_p),
                                 ("min_p", self.rows.min_p), ("seeds", self.rows.seed)):
                np.take(values, rows, out=host[name][:num_seqs])
            any_filter = bool((host["top_k"][:num_seqs] < self.vocab_size).any()
                              or (host["top_p"][:num_seqs] < 1).any() or host["min_p"][:num_seqs].any())
            # index of the output token each row draws: the token after the chunk's last position
            np.subtract(ends, self.rows.num_prompt_tokens[rows], out=host["sample_positions"][:num_seqs])
        self.buffers.upload(2 * num_staged)

        max_seq_len = int(ends.max())
        views = self._device_views(padded_seqs if graph_size else num_tokens, padded_seqs, num_seqs)
        if copy_previous_samples:
            views.decode_input_ids.copy_(previous.sampled)
        elif num_placeholders:
            placeholder_rows, placeholder_sources = self._placeholder_views(num_placeholders)
            views.input_ids.index_put_((placeholder_rows,), previous.sampled.index_select(0, placeholder_sources))
        sampling = SamplingTensors(
            temperatures=views.temperatures, top_k=views.top_k, top_p=views.top_p, min_p=views.min_p,
            seeds=views.seeds, positions=views.sample_positions, all_greedy=all_greedy, any_filter=any_filter)
        return StepInputs(
            input_ids=views.input_ids, positions=views.positions, slot_mapping=views.slot_mapping,
            query_start_loc=views.query_start_loc, seq_lens=views.seq_lens, rows=views.rows,
            table_updates=self._table_update_views(num_staged), logits_indices=views.logits_indices,
            sampling=sampling, max_query_len=1 if pure_decode else max(batch.num_new_tokens),
            max_seq_len=max_seq_len,
            decode_num_splits=self.backend.decode_num_splits(num_seqs, max_seq_len, self.num_kv_heads),
            graph_size=graph_size)

    def _slice_device_views(self, num_rows: int, padded_seqs: int, num_seqs: int) -> _DeviceViews:
        """The step buffers' device views for a step of these sizes (memoised: slicing a tensor is a torch
        call, and a decode step of a given size recurs every step)."""
        device = self.buffers.on_device
        per_row = {name: device[name][:num_rows] for name in ("input_ids", "positions", "slot_mapping")}
        per_seq = {name: device[name][:num_seqs] for name in ("logits_indices", "temperatures", "top_k", "top_p",
                                                              "min_p", "seeds", "sample_positions")}
        return _DeviceViews(**per_row, **per_seq, query_start_loc=device["query_start_loc"][:padded_seqs + 1],
                            seq_lens=device["seq_lens"][:padded_seqs], rows=device["rows"][:padded_seqs],
                            decode_input_ids=device["input_ids"][:num_seqs])

    def _slice_placeholder_views(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.buffers.on_device
        return device["placeholder_rows"][:count], device["placeholder_sources"][:count]

    def _slice_table_update_views(self, count: int) -> torch.Tensor:
        return self.buffers.on_device["table_updates"][:2 * count].view(2, count)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepHandle:
        """Launch forward + sampling and return at once (on the CPU the work is done by the time it returns).

        The sampled ids are copied to pinned host memory behind an event; `wait` blocks on that event only."""
        upload = self.buffers.num_uploads  # the step's inputs are the latest upload
        if self.device.type == "cpu":
            return StepHandle(self._forward_and_sample(inputs), None, None, None, upload)
        # The step loop waits for step N before it launches step N+2: two output slots are never both in use.
        slot = self._output_slots[self._next_slot]
        self._next_slot ^= 1
        start, end = slot.timing
        stream = self.buffers.stream
        start.record(stream)
        sampled = self._forward_and_sample(inputs)
        end.record(stream)
        host = slot.host[:len(sampled)]
        host.copy_(sampled, non_blocking=True)
        slot.ready.record(stream)
        return StepHandle(sampled, host, slot.timing, slot.ready, upload)

    def _forward_and_sample(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.graph_size is not None:  # the graph applies the table updates and gathers the tables itself
            logits = self.graphs.replay(inputs.graph_size, inputs)
        else:
            if inputs.table_updates.shape[1]:
                self.tables.apply(inputs.table_updates)
            meta = AttentionMetadata(
                slot_mapping=inputs.slot_mapping, query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
                block_tables=self.tables.gather(inputs.rows, -(-inputs.max_seq_len // self.block_size)),
                max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len,
                decode_num_splits=inputs.decode_num_splits)
            hidden = self.model(inputs.input_ids, inputs.positions, meta)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if logits is None:  # a tensor-parallel worker: the logits were gathered to rank 0, which samples
            return inputs.logits_indices[:0]
        return sample(logits[:len(inputs.logits_indices)], inputs.sampling)

    def wait(self, handle: StepHandle) -> tuple[list[int], float | None]:
        """The step's sampled ids, and its device time in seconds (None on the CPU)."""
        if handle.ready is None:
            return handle.sampled.tolist(), None
        handle.ready.synchronize()
        self.buffers.settle(handle.upload)  # the step's input upload ran before it
        start, end = handle.timing
        return handle.host.tolist(), start.elapsed_time(end) / 1000
