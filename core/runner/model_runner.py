from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm.attention import AttentionMetadata, select_backend
from nanovllm.attention.kv_quant import check_fp8_kv_supported
from nanovllm.config import EngineConfig
from nanovllm.distributed import min_over_ranks
from nanovllm.kv_groups import max_blocks_held, plan_kv_groups
from nanovllm.layers.logprobs import TokenLogprobs, chunked_logprobs, compute_logprobs
from nanovllm.layers.sampler import sample, warm_up_sampling
from nanovllm.loaders import ResolvedModel, load_weights
from nanovllm.loaders.quantization import fp8_scheme
from nanovllm.lora import LoRAAdapter, LoRALayers, LoRARequest, load_adapter
from nanovllm.lora.layers import StepSlotsModel
from nanovllm.models.geometry import head_dim_of, kv_block_bytes, kv_heads_per_rank
from nanovllm.models.registry import model_class_for
from nanovllm.pooling import PoolingSpec
from nanovllm.pooling.kv_budget import pooling_kv_blocks
from nanovllm.runner.cuda_graphs import DecodeGraphs, batch_size_ladder
from nanovllm.runner.inputs import LaunchedForward, SamplingTensors, StepInputs
from nanovllm.runner.logprob_step import copy_to_host, plan_logprobs
from nanovllm.runner.memory_budget import (
    MAX_AUTO_NUM_SEQS,
    MIN_AUTO_NUM_SEQS,
    EngineMemoryMeter,
    WorstStep,
    auto_max_num_seqs,
    kv_cache_bytes,
    release_process_workspaces,
)
from nanovllm.runner.persistent_batch import PersistentBatch
from nanovllm.runner.pooling_step import PoolingPlan, PoolingStep
from nanovllm.runner.step_buffers import (
    GROUP_TOKENS,
    ROWS,
    ROWS_PLUS_ONE,
    SEQS,
    TOKENS,
    UPDATES,
    Field,
    StepBuffers,
    buffer_fields,
    sliced_views,
)
from nanovllm.sampling_params import MAX_LOGPROBS
from nanovllm.step_types import LogprobPlan, PooledOutputs, ScheduledBatch, StepHandle, StepLogprobs

if TYPE_CHECKING:
    from nanovllm.structured import DeviceMask, StepMask

_STEP_FIELDS = {f.name for f in fields(StepInputs)}
_SAMPLING_FIELDS = {f.name for f in fields(SamplingTensors)}
_PROMPT_LOGITS_CHUNK = 1024  # prompt positions whose logits exist at once (bounds a long prompt's temporaries)


def _slice_views(on_device: dict[str, torch.Tensor], num_groups: int, num_tokens: int, padded_seqs: int,
                 num_seqs: int) -> _Views:
    views = sliced_views(StepInputs, on_device,
                         {TOKENS: num_tokens, ROWS: padded_seqs, ROWS_PLUS_ONE: padded_seqs + 1, SEQS: num_seqs,
                          GROUP_TOKENS: (num_groups, num_tokens)})
    return _Views({name: view for name, view in views.items() if name in _STEP_FIELDS},
                  {name: view for name, view in views.items() if name in _SAMPLING_FIELDS},
                  on_device["input_ids"][:num_seqs])


def _slice_pending_views(on_device: dict[str, torch.Tensor], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    return on_device["pending_tokens"][:count], on_device["pending_sources"][:count]


def _slice_table_update_views(on_device: dict[str, torch.Tensor], count: int) -> torch.Tensor:
    return sliced_views(StepInputs, on_device, {UPDATES: (2, count)})["table_updates"]


@dataclass(frozen=True)
class _Views:
    """One step size's device views, split as StepInputs nests them (memoised: slicing a tensor is a torch
    call, and a decode step of a given size recurs every step)."""

    step: dict[str, torch.Tensor]
    sampling: dict[str, torch.Tensor]
    decode_input_ids: torch.Tensor  # one per sequence, padding excluded: where a steady decode's inputs go


@dataclass
class _OutputSlot:
    """Pinned host memory for one step's sampled ids, and that step's events; reused every other step."""

    host: torch.Tensor
    timing: tuple[torch.cuda.Event, torch.cuda.Event]
    ready: torch.cuda.Event


class ModelRunner:
    """Executes scheduled batches: builds the model, owns the KV cache, prepares inputs, runs forward + sampling
    (a pooling model's steps: forward + pooling, runner/pooling_step.py)."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int, eos_token_ids: list[int],
                 pooling: PoolingSpec | None = None):
        started = time.perf_counter()
        self.startup_s: dict[str, float] = {}  # seconds of each phase of building the runner (LLM.info)
        self.config = config
        self.hf_config = resolved.hf_config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        check_fp8_kv_supported(config.kv_cache_dtype, self.device)  # before any weight is loaded
        self.kv_cache_dtype = config.resolve_kv_cache_dtype(self.device)
        # Chosen before any weight is loaded: an unsupported combination fails at once.
        self.block_size = config.block_size
        self.backend = backend = select_backend(config.attention_backend, self.device, config.kv_cache_dtype)
        if self.block_size % backend.required_block_size_multiple:
            raise ValueError(f"the {backend.name} attention backend needs a block_size divisible by "
                             f"{backend.required_block_size_multiple}; got block_size={self.block_size}")
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.vocab_size = self.hf_config.vocab_size
        self.num_kv_heads = kv_heads_per_rank(self.hf_config)

        model_class = model_class_for(self.hf_config, pooling.model_kind if pooling else "generate")
        self.fp8 = fp8_scheme(config.quantization, resolved, self.device, hasattr(model_class, "expert_projections"))
        if config.enable_lora and self.fp8 is not None:
            raise ValueError("enable_lora with FP8 weights (quantization='fp8' or an FP8 checkpoint): LoRA adapters "
                             "apply to unquantized linear layers only; serve the model in its 16-bit dtype, or merge "
                             "the adapter into it (PEFT's merge_and_unload) and quantize the merged model")
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(self.hf_config, fused_ops=config.fused_ops and self.device.type == "cuda")
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(self.model, resolved.weights_dir, self.fp8, seed=config.seed)
        self.model.eval()
        # Adapter slots on every linear layer, before the memory profile (they are the engine's memory too).
        self.lora = (LoRALayers(self.model, config.max_loras, config.max_lora_rank, self.dtype)
                     if config.enable_lora else None)
        self.startup_s["load_weights"] = time.perf_counter() - started
        self.kv_groups = plan_kv_groups([layer.sliding_window for layer in self.model.attention_layers()])
        self.num_groups = self.kv_groups.num_groups

        started = time.perf_counter()
        self.num_kv_blocks = config.num_kv_blocks or min_over_ranks(self._cache_blocks(pooling))  # TP: every rank
        self.startup_s["worst_step"] = time.perf_counter() - started
        needed = max_blocks_held(self.kv_groups.windows, max_model_len, self.block_size, config.max_num_batched_tokens)
        # Checked before anything (CUDA graphs included) touches the cache; an encoder (no KV groups' width) has none.
        if self.kv_groups.width and self.num_kv_blocks < needed:
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks} blocks, less than the {needed} one sequence of "
                f"max_model_len={max_model_len} needs: lower max_model_len, or raise gpu_memory_utilization / "
                "num_kv_blocks (cpu_kv_cache_bytes on the CPU); gpu_memory_utilization is this engine's share of "
                "the device, and the cache also takes no more than is free")
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self._bind_kv_cache(self.kv_cache)
        self.attention_backend = backend.name

        self.max_num_seqs = config.max_num_seqs or self._default_max_num_seqs()
        self.max_batch_size = min(self.max_num_seqs, config.max_num_batched_tokens)
        self.buffers = StepBuffers(self._buffer_fields(), self.device)
        self.persistent = PersistentBatch(self.max_batch_size, self.max_blocks_per_seq, self.num_groups,
                                          self.block_size, self.vocab_size, eos_token_ids, self.device)
        self.tables = self.persistent.tables
        # Memoised slicing of the device views (a torch call per tensor, and a step of a given size recurs). The
        # caches hold the views, not the runner, so that dropping the engine frees it without a garbage collection.
        on_device = self.buffers.on_device
        self._views = functools.lru_cache(maxsize=4096)(functools.partial(_slice_views, on_device, self.num_groups))
        self._pending_views = functools.lru_cache(maxsize=1024)(functools.partial(_slice_pending_views, on_device))
        self._table_update_views = functools.lru_cache(maxsize=4096)(
            functools.partial(_slice_table_update_views, on_device))
        self._logprob_plan: LogprobPlan | None = None  # the prepared step's, until it is launched
        self.pooling = None if pooling is None else PoolingStep(pooling, len(self.persistent.rows.host_tables),
                                                                self.hf_config.hidden_size, self.device)
        self._pooling_plan: PoolingPlan | None = None  # likewise (rank 0 only: the other ranks run the forward)
        if self.device.type == "cuda":
            self._output_slots = [
                _OutputSlot(torch.empty(self.max_batch_size, dtype=torch.int64, pin_memory=True),
                            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)),
                            torch.cuda.Event())
                for _ in range(2)]
            self._next_slot = 0
        self._device_mask: DeviceMask | None = None  # applies structured outputs' masks; made on first use
        self.graphs: DecodeGraphs | None = None
        self.lora_graphs: DecodeGraphs | None = None  # the decode steps with LoRA adapters in the batch
        if self._uses_graphs and not pooling:
            started = time.perf_counter()
            self.graphs = DecodeGraphs(self.model, self._graph_inputs, self.tables, self.max_batch_size,
                                       max_model_len, self.block_size, self.num_groups)
            if self.lora is not None:
                token_slots = self.buffers.on_device["lora_slots"]
                token_slots.fill_(-1)  # captured on base-model tokens: valid slots, no adapter read
                self.lora_graphs = DecodeGraphs(StepSlotsModel(self.model, self.lora, token_slots), self._graph_inputs,
                                                self.tables, self.max_batch_size, max_model_len, self.block_size,
                                                self.num_groups)
                self.lora.set_step(None)
            self.startup_s["cuda_graphs"] = time.perf_counter() - started
        if self.device.type == "cuda" and pooling is None:  # every sampling kernel compiled now, not in a job
            started = time.perf_counter()
            warm_up_sampling(self.device, self.vocab_size, self.dtype)
            self.startup_s["sampling_kernels"] = time.perf_counter() - started

    def release(self) -> None:
        """Free the device memory (weights, KV cache, CUDA graphs, step buffers); the runner runs no more steps."""
        if self.released:
            return
        for graphs in (self.graphs, self.lora_graphs):
            if graphs is not None:
                graphs.release()
        self.model = self.kv_cache = self.graphs = self.lora_graphs = self.lora = None
        self.tables = self.buffers = self.persistent = self.pooling = None
        self._views = self._pending_views = self._table_update_views = self._device_mask = None
        if self.device.type == "cuda":
            gc.collect()  # whatever a CUDA graph or a kernel cache still ties into a cycle, before the cache is emptied
            release_process_workspaces()

    def device_error(self) -> str | None:
        """After a failed step: why the device can run nothing more (a sticky CUDA error), or None when it can.
        Waiting for the device also drains whatever the failed step had launched."""
        if self.device.type != "cuda":
            return None
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as exc:  # CUDA reports a broken context only this way
            return str(exc)
        return None

    @property
    def decode_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes a decode step is padded to (its CUDA graphs' sizes, where it has graphs)."""
        return tuple(batch_size_ladder(self.max_batch_size))

    @property
    def released(self) -> bool:
        return self.model is None

    # ---- KV cache --------------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        return kv_block_bytes(self.hf_config, self.block_size, self.kv_cache_dtype.itemsize, self.num_kv_heads,
                              self.kv_groups.width)

    @property
    def _uses_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager and self.backend.supports_cuda_graphs

    def _default_max_num_seqs(self) -> int:
        """The batch when the user sets none: on a GPU as large as the cache allows (memory_budget.py), on the
        CPU (a reference path with a small fixed budget) the smallest default."""
        if self.device.type == "cpu":
            return MIN_AUTO_NUM_SEQS
        return min_over_ranks(auto_max_num_seqs(self.num_kv_blocks * self.block_size))

    def _cache_blocks(self, pooling: PoolingSpec | None) -> int:
        """The blocks this rank's cache takes: what the budget allows, but none for a model without attention layers
        (an encoder), and for a pooling engine only what its prefills in flight hold (pooling/kv_budget.py)."""
        if not self.kv_groups.width:
            return 0
        if pooling is None:
            return self._kv_budget_blocks(samples=True)
        config = self.config
        return min(self._kv_budget_blocks(samples=False), pooling_kv_blocks(config.max_num_batched_tokens, self.max_model_len,
                                                               config.max_num_seqs or MAX_AUTO_NUM_SEQS,
                                                               self.block_size, self.num_groups))

    def _kv_budget_blocks(self, samples: bool) -> int:
        """The blocks the memory budget leaves beside the worst step (`samples`: its rows are sampled; a pooling
        engine's are pooled, its "logits" are hidden states)."""
        if self.device.type == "cpu":
            return self.config.cpu_kv_cache_bytes // self.kv_block_bytes
        meter = EngineMemoryMeter(self.device)
        # The worst step of the largest batch this engine may choose (it reserves at least the chosen one's).
        rows = min(self.config.max_num_seqs or MAX_AUTO_NUM_SEQS, self.config.max_num_batched_tokens)
        scratch = self._allocate_kv_cache(1)  # every write skipped, every table entry pointing at it: real
        self._bind_kv_cache(scratch)          # shapes reading valid memory, touching no real KV
        def worst_forward():
            logits = self._warmup_forward(self.config.max_num_batched_tokens, rows)
            if samples and logits is not None:  # tensor parallelism: rank 0 alone gets the logits and samples
                self._sample_worst(logits)

        worst = WorstStep(activations=meter.peak_of(worst_forward),
                          graph_pool=meter.peak_of(lambda: self._warmup_forward(rows, rows)) if self._uses_graphs else 0)
        self._warmup_mixed_step()
        del scratch
        self._bind_kv_cache(None)
        budget = kv_cache_bytes(meter.measure(self.model, worst), self.config.gpu_memory_utilization)
        return budget // self.kv_block_bytes

    def _warmup_forward(self, num_tokens: int, num_seqs: int) -> torch.Tensor:
        """The logits of a prefill of `num_tokens` tokens over `num_seqs` sequences (each within max_model_len),
        every sequence's last token sampled, on the scratch cache."""
        num_tokens = min(num_tokens, num_seqs * self.max_model_len)
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        return self._scratch_forward(lens, lens)

    def _warmup_mixed_step(self) -> None:
        """A step of a stream on the scratch cache: decodes of long contexts split over the KV range, then an
        odd-sized prompt chunk; it compiles the kernel variants a mixed step uses, which a prefill and the decode
        graphs do not."""
        context = min(4096, self.max_model_len)
        chunk = max(min(255, self.max_model_len, self.config.max_num_batched_tokens - 4), 1)
        decodes = 4
        self._scratch_forward([1] * decodes + [chunk], [context] * decodes + [chunk], decodes,
                              self.backend.decode_num_splits(decodes, context, self.num_kv_heads))

    @torch.inference_mode()
    def _scratch_forward(self, query_lens: list[int], seq_lens: list[int], num_decodes: int = 0,
                         decode_num_splits: int = 1) -> torch.Tensor:
        """The logits of a forward whose sequence i computes its last `query_lens[i]` of `seq_lens[i]`
        positions, every sequence's last token sampled, on the scratch cache (no write, every block the scratch)."""
        num_tokens, num_seqs = sum(query_lens), len(query_lens)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(s - q, s, device=self.device) for q, s in zip(query_lens, seq_lens)])
        starts = torch.tensor([0] + query_lens, device=self.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        groups = self.num_groups
        meta = AttentionMetadata.grouped(
            slot_mapping=torch.full((groups, num_tokens), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(groups, num_seqs, self._eager_table_width(max(seq_lens)), dtype=torch.int32,
                                     device=self.device),
            query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_decodes=num_decodes,
            decode_num_splits=decode_num_splits)
        if self.lora is not None:  # every token through the adapters' update too: its temporaries count
            self.lora.set_step(torch.zeros(num_tokens, dtype=torch.int32, device=self.device))
        hidden = self.model(ids, positions, meta)
        logits = self.model.compute_logits(hidden[starts[1:] - 1])
        if self.lora is not None:
            self.lora.set_step(None)
        return logits

    def _eager_table_width(self, max_seq_len: int) -> int:
        """Blocks of each table an eager step gathers: enough for its longest context, rounded up to a multiple
        of 16, so that the attention kernels see one table stride class (Triton specializes an integer argument
        by its divisibility by 16) and no step compiles a variant the warm-up did not."""
        return min(-(-max_seq_len // (16 * self.block_size)) * 16, self.max_blocks_per_seq)

    @torch.inference_mode()
    def _sample_worst(self, logits: torch.Tensor) -> None:
        """Sampling's heaviest path on every row of `logits`: a structured-output mask on each, the float32 copy
        the logit controls edit, every filter, and the most logprobs a row may ask, so that their workspaces are in
        the measured peak."""
        from nanovllm.kernels.token_bitmask import apply_token_bitmask, bitmask_width  # CUDA only: Triton

        rows = len(logits)
        every_row = torch.arange(rows, device=self.device)
        apply_token_bitmask(logits, torch.full((rows, bitmask_width(self.vocab_size)), -1, dtype=torch.int32,
                                               device=self.device), every_row)
        scores = logits.float()
        settings = SimpleNamespace(
            temperatures=torch.full((rows,), 0.8, device=self.device),
            top_k=torch.full((rows,), 50, dtype=torch.int64, device=self.device),
            top_p=torch.full((rows,), 0.9, device=self.device), min_p=torch.full((rows,), 0.05, device=self.device),
            seeds=torch.arange(rows, dtype=torch.int64, device=self.device),
            sample_positions=torch.zeros(rows, dtype=torch.int64, device=self.device),
            all_greedy=False, any_filter=True)
        sampled = sample(scores, settings)
        compute_logprobs(logits, sampled, MAX_LOGPROBS)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """K and V of `num_blocks` blocks of the KV groups' width (kv_groups.py)."""
        hf = self.hf_config
        shape = (2, self.kv_groups.width, num_blocks, self.block_size, kv_heads_per_rank(hf), head_dim_of(hf))
        return torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)

    def _bind_kv_cache(self, cache: torch.Tensor | None) -> None:
        """Point every attention layer at its slot of `cache` (None: at none) and its KV group."""
        for layer, (group, slot) in zip(self.model.attention_layers(), self.kv_groups.layer_slots):
            layer.k_cache, layer.v_cache = (None, None) if cache is None else (cache[0, slot], cache[1, slot])
            layer.kv_group = group
            layer.backend = self.backend

    # ---- one step ----------------------------------------------------------------------------------------------

    def _buffer_fields(self) -> list[Field]:
        max_seqs = self.max_batch_size
        layout = buffer_fields(StepInputs, {
            TOKENS: self.config.max_num_batched_tokens, ROWS: max_seqs, ROWS_PLUS_ONE: max_seqs + 1, SEQS: max_seqs,
            UPDATES: 2 * max_seqs * self.num_groups * self.max_blocks_per_seq,  # at most every table of a batch
            GROUP_TOKENS: self.num_groups * self.config.max_num_batched_tokens})
        # Scratch for the pending inputs' gather (see _gather_pending), before the table updates, which stay last.
        layout[-1:-1] = [Field("pending_tokens", torch.int64, max_seqs), Field("pending_sources", torch.int64, max_seqs)]
        return layout

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Device inputs for `batch`, in named steps: the persistent batch's rows and table updates, the step's
        shape (a decode graph's size, or eager), token inputs, sampling settings, logit controls, pending inputs.
        A pending input (see ScheduledBatch) is taken on the device from the output of the step launched before,
        which may still be running."""
        num_seqs = len(batch.seqs)
        persistent = self.persistent
        if batch.lora_loads:
            self.load_adapters(batch.lora_loads)
        host = self.buffers.begin()
        rows, update_indices, update_blocks = persistent.sync(batch)
        plan = self._logprob_plan = plan_logprobs(persistent.rows, batch, rows)
        graph_size = self._graph_size(batch, plan, len(update_blocks))
        num_staged = persistent.stage_table_updates(host, update_indices, update_blocks,
                                                    graph_size and graph_size * self.num_groups)
        padded_seqs = graph_size or num_seqs
        steady = persistent.is_steady_decode(batch, rows)
        ends = persistent.fill_token_inputs(host, batch, rows, padded_seqs, steady)
        lora_active = self.lora is not None and persistent.fill_lora_slots(
            host, batch, rows, padded_seqs if graph_size else batch.num_tokens)
        all_greedy, any_filter = persistent.fill_sampling(host, rows, ends)
        if plan is not None:
            host["logprob_rows"][:len(plan.sampled_indices)] = plan.sampled_indices
        controls_on, num_penalty_rows = persistent.fill_controls(host, rows, ends, batch.samples, all_greedy)
        num_gathered = 0 if steady else persistent.stage_pending(host, batch, rows)
        persistent.remember(rows)
        self.buffers.upload(2 * num_staged)

        views = self._views(padded_seqs if graph_size else batch.num_tokens, padded_seqs, num_seqs)
        if steady:
            views.decode_input_ids.copy_(persistent.last_sampled)
        elif num_gathered:
            tokens, sources = self._pending_views(num_gathered)
            views.step["input_ids"].index_put_((tokens,), persistent.last_sampled.index_select(0, sources))
        max_seq_len = int(ends.max())
        if batch.num_tokens == num_seqs:
            max_query_len, num_decodes, decode_len = 1, 0, max_seq_len
        else:
            num_new = np.asarray(batch.num_new_tokens)
            longer = np.flatnonzero(num_new != 1)
            max_query_len, num_decodes = int(num_new.max()), int(longer[0])
            decode_len = int(ends[:num_decodes].max()) if num_decodes else 1
        prompt_targets = None
        if plan is not None and plan.prompt_targets is not None:
            prompt_targets = torch.from_numpy(plan.prompt_targets).to(self.device, non_blocking=True)
        if self.pooling is not None:
            self._pooling_plan = self.pooling.plan(batch)
        return StepInputs(
            **views.step, table_updates=self._table_update_views(num_staged),
            sampling=SamplingTensors(**views.sampling, all_greedy=all_greedy, any_filter=any_filter),
            num_logprob_rows=len(plan.sampled_indices) if plan else 0,
            num_top_logprobs=plan.num_top if plan else 0, prompt_logprob_targets=prompt_targets,
            num_top_prompt_logprobs=plan.num_top_prompt if plan else 0, num_penalty_rows=num_penalty_rows,
            logit_controls=controls_on, lora_active=lora_active,
            max_query_len=max_query_len, max_seq_len=max_seq_len, num_decodes=num_decodes,
            decode_num_splits=self.backend.decode_num_splits(num_decodes or num_seqs, decode_len, self.num_kv_heads),
            graph_size=graph_size, token_type_ids=self.pooling.token_type_ids(batch) if self.pooling else None)

    def _graph_size(self, batch: ScheduledBatch, plan: LogprobPlan | None, num_updates: int) -> int | None:
        """The decode graph a step replays (its padded batch size), or None to run it eagerly."""
        if self.graphs is None or batch.num_tokens != len(batch.seqs):
            return None
        if plan is not None and plan.prompt_targets is not None:
            return None  # prompt positions' logits come from the hidden states an eager step keeps
        graph_size = self.graphs.batch_size_for(len(batch.seqs))
        if graph_size is not None and num_updates > graph_size * self.num_groups:
            return None  # a graph applies a new block per row and KV group; a readmitted sequence brings more
        return graph_size

    def _graph_inputs(self, size: int) -> StepInputs:
        """The step buffers' views for a decode graph of `size` rows, which it captures (what they hold is set
        by DecodeGraphs)."""
        views = self._views(size, size, size)
        return StepInputs(
            **views.step, table_updates=self._table_update_views(size * self.num_groups),
            sampling=SamplingTensors(**views.sampling, all_greedy=True, any_filter=False), num_logprob_rows=0,
            num_top_logprobs=0, prompt_logprob_targets=None, num_top_prompt_logprobs=0, num_penalty_rows=0,
            logit_controls=False, lora_active=False, max_query_len=1, max_seq_len=self.max_model_len, num_decodes=0,
            decode_num_splits=self.backend.decode_num_splits(size, self.max_model_len, self.num_kv_heads),
            graph_size=size)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepHandle:
        """Launch forward + sampling and return at once (on the CPU the work is done by the time it returns).

        The sampled ids are copied to pinned host memory behind an event; `wait` blocks on that event only."""
        if self.pooling is not None:
            return self._execute_pooling(inputs)
        return self.launch_sample(self.launch_forward(inputs), None)

    def _execute_pooling(self, inputs: StepInputs) -> StepHandle:
        """A pooling model's step: the forward, then the pooling and outputs of runner/pooling_step.py (on rank 0;
        the other ranks have no plan), copied to pinned host memory behind the step's event."""
        upload, slot = self.buffers.num_uploads, self._take_output_slot()
        hidden = self._eager_hidden_states(inputs)
        plan, self._pooling_plan = self._pooling_plan, None
        values = None if plan is None else self.pooling.launch(self.model, hidden, inputs.query_start_loc,
                                                                inputs.positions, inputs.rows, plan)
        pooled = None if values is None else PooledOutputs(plan.batch_indices, plan.offsets, values)
        nothing_sampled = inputs.logits_indices[:0]
        if slot is None:
            return StepHandle(nothing_sampled, None, None, None, upload, pooled=pooled)
        slot.timing[1].record(self.buffers.stream)
        if pooled is not None:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            pooled.values = host.copy_(values, non_blocking=True)
        slot.ready.record(self.buffers.stream)
        return StepHandle(nothing_sampled, None, slot.timing, slot.ready, upload, pooled=pooled)

    def _take_output_slot(self) -> _OutputSlot | None:
        """The output slot of a step being launched (None on the CPU), its start recorded."""
        if self.device.type != "cuda":
            return None
        # The step loop waits for step N before it launches step N+2: two output slots are never both in use.
        slot = self._output_slots[self._next_slot]
        self._next_slot ^= 1
        slot.timing[0].record(self.buffers.stream)
        return slot

    @torch.inference_mode()
    def launch_forward(self, inputs: StepInputs) -> LaunchedForward:
        """The first half of `execute`: launch the forward, up to the logits (and the prompt logprobs of rows that
        asked). A step with structured-output rows is launched in two halves, so that their masks can be filled in
        between (docs/STRUCTURED_OUTPUTS.md)."""
        upload = self.buffers.num_uploads  # the step's inputs are the latest upload
        slot = self._take_output_slot()
        logits, prompt_logprobs = self._forward(inputs)
        return LaunchedForward(inputs, logits, slot, upload, prompt_logprobs)

    @torch.inference_mode()
    def launch_sample(self, launched: LaunchedForward, step_mask: StepMask | None) -> StepHandle:
        """The second half of `execute`: mask the constrained rows' logits (`step_mask`, filled on the host),
        apply the logit controls, sample, take the logprobs of the rows that asked, and copy the ids to the host."""
        inputs, logits = launched.inputs, launched.logits
        graph = inputs.graph_size is not None
        plan, self._logprob_plan = self._logprob_plan, None
        sampled_lp = None
        if logits is None:  # a tensor-parallel worker: the logits were gathered to rank 0, which samples
            sampled = inputs.logits_indices[:0]
        else:
            logits = logits[:len(inputs.logits_indices)]
            if step_mask is not None:
                if self._device_mask is None:
                    from nanovllm.structured.bitmask import DeviceMask
                    self._device_mask = DeviceMask(self.device)
                self._device_mask.apply(step_mask, logits)
            sampled, sampled_lp = self._sample(logits, inputs)
        self.persistent.last_sampled = sampled
        slot = launched.slot
        if slot is None:
            logprobs = StepLogprobs(plan, sampled_lp, launched.prompt_logprobs) if plan else None
            return StepHandle(sampled, None, None, None, launched.upload, logprobs, graph)
        stream = self.buffers.stream
        slot.timing[1].record(stream)
        host = slot.host[:len(sampled)]
        host.copy_(sampled, non_blocking=True)
        logprobs = (StepLogprobs(plan, copy_to_host(sampled_lp), copy_to_host(launched.prompt_logprobs))
                    if plan else None)
        slot.ready.record(stream)
        return StepHandle(sampled, host, slot.timing, slot.ready, launched.upload, logprobs, graph)

    def check_adapter(self, adapter: LoRAAdapter) -> None:
        """Raise ValueError when a LoRA adapter does not fit the model's layers (lora/manager.py asks)."""
        self.lora.check(adapter)

    def load_adapters(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Write each adapter into its device slot, in order, on the step stream: after the steps launched before,
        which still read what the slots held. Every tensor-parallel rank reads its own shard from the adapter's
        files."""
        for slot, request in loads:
            self.lora.load(slot, load_adapter(request.lora_path, self.config.max_lora_rank, request.lora_name))

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor | None, TokenLogprobs | None]:
        """The step's logits (None on a tensor-parallel worker: they were gathered to rank 0), and the prompt
        logprobs of the rows that asked (every rank computes them: the LM head is collective)."""
        prompt_lp = None
        if inputs.graph_size is not None:  # the graph applies the table updates and gathers the tables itself
            graphs = self.lora_graphs if inputs.lora_active else self.graphs
            logits = graphs.replay(inputs.graph_size, inputs)
        else:
            hidden = self._eager_hidden_states(inputs)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            if inputs.prompt_logprob_targets is not None:
                prompt_lp = self._prompt_logprobs(hidden, inputs.prompt_logprob_targets,
                                                  inputs.num_top_prompt_logprobs)
        return logits, prompt_lp

    def _eager_hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """The step's final hidden states by an eager forward (the table updates applied first)."""
        if self.lora is not None:
            self.lora.set_step(inputs.lora_slots if inputs.lora_active else None)
        if inputs.table_updates.shape[1]:
            self.tables.apply(inputs.table_updates)
        meta = AttentionMetadata.grouped(
            slot_mapping=inputs.slot_mapping, block_tables=self.tables.gather_groups(
                inputs.rows, self.num_groups, self._eager_table_width(inputs.max_seq_len)),
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
            max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len,
            decode_num_splits=inputs.decode_num_splits, num_decodes=inputs.num_decodes)
        if inputs.token_type_ids is not None:
            return self.model(inputs.input_ids, inputs.positions, meta, token_type_ids=inputs.token_type_ids)
        return self.model(inputs.input_ids, inputs.positions, meta)

    def _sample(self, logits: torch.Tensor, inputs: StepInputs) -> tuple[torch.Tensor, TokenLogprobs | None]:
        """Logit controls, sampling, and the sampled tokens' logprobs of the rows that asked (of the raw
        distribution: the logits before the controls; a structured-output mask does apply to them)."""
        scores, penalty = logits, None
        if inputs.logit_controls:
            count = inputs.num_penalty_rows
            if count:
                penalty = (inputs.penalty_rows[:count], inputs.penalty_slots[:count],
                           inputs.repetition_penalties[:count], inputs.presence_penalties[:count],
                           inputs.frequency_penalties[:count])
            scores = self.persistent.controls.apply(logits, inputs.rows[:len(logits)], inputs.sampling.sample_positions,
                                         penalty)
        sampled = sample(scores, inputs.sampling)
        if penalty is not None:
            self.persistent.controls.record(sampled, penalty[0], penalty[1])
        sampled_lp = None
        if inputs.num_logprob_rows:
            rows = inputs.logprob_rows[:inputs.num_logprob_rows]
            sampled_lp = compute_logprobs(logits.index_select(0, rows), sampled.index_select(0, rows),
                                          inputs.num_top_logprobs)
        return sampled, sampled_lp

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, num_top: int) -> TokenLogprobs | None:
        """Logprobs of the prompt tokens `targets` scores ([2, n]: token index in the step, prompt token), from
        the logits of those positions (every rank: the LM head is collective)."""
        return chunked_logprobs(lambda start, end: self.model.compute_logits(hidden.index_select(0, targets[0, start:end])),
                                targets[1], num_top, _PROMPT_LOGITS_CHUNK)

    def wait(self, handle: StepHandle) -> tuple[list[int] | PooledOutputs | None, float | None]:
        """The step's sampled ids (a pooling model's: its pooled outputs), and its device time in seconds (None
        on the CPU)."""
        if handle.ready is None:
            return handle.pooled if self.pooling is not None else handle.sampled.tolist(), None
        handle.ready.synchronize()
        self.buffers.settle(handle.upload)  # the step's input upload ran before it
        start, end = handle.timing
        return handle.pooled if self.pooling is not None else handle.host.tolist(), start.elapsed_time(end) / 1000
