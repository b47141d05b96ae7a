from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.attention import AttentionMetadata, select_backend
from nanovllm.config import EngineConfig
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.layers.sampler import SamplingTensors, sample
from nanovllm.loaders import ResolvedModel, load_dummy_weights, load_safetensors_weights
from nanovllm.models.llama import LlamaForCausalLM, head_dim_of, kv_heads_per_rank


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the last new token of each sequence
    sampling: SamplingTensors


@dataclass
class StepHandle:
    """A launched step: sampled ids on the device, their pinned host copy, timing events, the copy's event."""

    sampled: torch.Tensor
    host: torch.Tensor | None
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None
    ready: torch.cuda.Event | None


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

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = LlamaForCausalLM(self.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        if resolved.weights_dir is None:
            load_dummy_weights(self.model, seed=config.seed)
        else:
            load_safetensors_weights(self.model, resolved.weights_dir)
        self.model.eval()

        self.num_kv_blocks = config.num_kv_blocks or self._kv_budget_blocks()
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        backend = select_backend(config.attention_backend, self.device)
        for index, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = self.kv_cache[0, index], self.kv_cache[1, index]
            layer.backend = backend
        self.attention_backend = backend.name

    # ---- KV cache --------------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        hf = self.hf_config
        return (2 * hf.num_hidden_layers * self.block_size * kv_heads_per_rank(hf) * head_dim_of(hf)
                * self.dtype.itemsize)

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
        # A one-block scratch cache with every write skipped: the forward has real shapes but touches no KV.
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
            block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32, device=self.device),
            max_query_len=max(lens), max_seq_len=max(lens),
        )
        hidden = self.model(ids, positions, meta)
        self.model.compute_logits(hidden[starts[1:] - 1])

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        hf = self.hf_config
        shape = (2, hf.num_hidden_layers, num_blocks, self.block_size, kv_heads_per_rank(hf), head_dim_of(hf))
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    # ---- one step ----------------------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch, previous: StepHandle | None = None) -> StepInputs:
        """Device inputs for `batch`. A position past a sequence's known tokens is the token that the previous
        (still running) step samples for it: its id is gathered on the device from that step's output."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        placeholder_rows: list[int] = []  # rows of input_ids to take from the previous step's samples
        placeholder_sources: list[int] = []
        block_size = self.block_size
        for seq, num_new, start, source in zip(batch.seqs, batch.num_new_tokens, batch.start_positions,
                                               batch.placeholder_sources):
            end = start + num_new
            known = seq.token_ids[start:end]
            if source >= 0:  # only ever the last token of a decode, sampled by the step in flight
                placeholder_rows.append(len(input_ids) + len(known))
                placeholder_sources.append(source)
                known = known + [0]
            input_ids.extend(known)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(-1 if p < seq.num_shared_kv_tokens else table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))
            query_start.append(query_start[-1] + num_new)
            seq_lens.append(end)
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [-1] * (max_blocks - len(seq.block_table)) for seq in batch.seqs]

        pin = self.device.type == "cuda"

        def tensor(data, dtype):
            # Pinned + non_blocking: the copy is queued on the stream and never waits for the step in flight.
            return torch.tensor(data, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

        ids = tensor(input_ids, torch.int64)
        if placeholder_rows:
            ids[tensor(placeholder_rows, torch.int64)] = previous.sampled[tensor(placeholder_sources, torch.int64)]
        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(query_start, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        params = [seq.params for seq in batch.seqs]
        sampling = SamplingTensors(
            temperatures=tensor([p.temperature for p in params], torch.float32),
            top_k=tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seeds=tensor([seq.sampling_seed for seq in batch.seqs], torch.int64),
            # index of the output token each row draws (pending tokens of the step in flight come first)
            positions=tensor([seq.num_output_tokens + seq.num_pending_tokens - 1 for seq in batch.seqs],
                             torch.int64),
            all_greedy=all(p.temperature == 0 for p in params),
            any_filter=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
        )
        return StepInputs(ids, tensor(positions, torch.int64), meta, tensor(query_start[1:], torch.int64) - 1,
                          sampling)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepHandle:
        """Launch forward + sampling and return at once (on the CPU the work is done by the time it returns).

        The sampled ids are copied to pinned host memory behind an event; `wait` blocks on that event only."""
        if self.device.type == "cpu":
            return StepHandle(self._forward_and_sample(inputs), None, None, None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sampled = self._forward_and_sample(inputs)
        end.record()
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return StepHandle(sampled, host, (start, end), ready)

    def _forward_and_sample(self, inputs: StepInputs) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        return sample(logits, inputs.sampling)

    @staticmethod
    def wait(handle: StepHandle) -> tuple[list[int], float | None]:
        """The step's sampled ids, and its device time in seconds (None on the CPU)."""
        if handle.ready is None:
            return handle.sampled.tolist(), None
        handle.ready.synchronize()
        start, end = handle.timing
        return handle.host.tolist(), start.elapsed_time(end) / 1000
