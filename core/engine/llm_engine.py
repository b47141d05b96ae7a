from __future__ import annotations

import dataclasses
import itertools
import random
import sys
import threading
import time
from contextlib import nullcontext

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.choice_scores import ChoicesAPI
from nanovllm.engine.info import EngineInfo, model_costs
from nanovllm.engine.outputs import OutputAssembler, RequestOutput
from nanovllm.engine.pooling_api import PoolingAPI
from nanovllm.engine.pooling_outputs import PoolingOutputAssembler, PoolingRequestOutput
from nanovllm.engine.pooling_scheduler import PoolingScheduler
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import EngineStats
from nanovllm.engine.step_loop import StepLoop
from nanovllm.engine.stop_strings import StopStringDetector
from nanovllm.loaders import resolve_model
from nanovllm.lora import LoRARequest
from nanovllm.lora.manager import LoRAManager
from nanovllm.pooling import resolve_task
from nanovllm.pooling_params import PoolingParams
from nanovllm.quoting import quoted
from nanovllm.runner.logit_controls import HISTORY_WINDOW
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.tp_workers import TPRunner, TPWorkerError, start_workers
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured.compile_cache import GrammarCompileCache
from nanovllm.structured.manager import GrammarManager
from nanovllm.tokenization import Prompt, PromptTokenizer


class StepFailedError(RuntimeError):
    """A step raised. Every unfinished request was aborted (`request_ids`: they get no output; add them again to
    rerun them). `engine_usable`: the engine is back in a clean state and takes new requests; otherwise it must be
    exited (a broken device, or tensor-parallel workers whose state is unknown)."""

    def __init__(self, cause: BaseException, request_ids: list[str], engine_usable: bool):
        what = "the engine takes new requests" if engine_usable else "the engine cannot run any more: make a new LLM"
        super().__init__(f"a step failed: {type(cause).__name__}: {cause} ({len(request_ids)} unfinished requests "
                         f"aborted; {what})")
        self.request_ids = request_ids
        self.engine_usable = engine_usable


class LLM(PoolingAPI, ChoicesAPI):
    """Offline batch generation: `generate`/`chat` for whole batches, or `add_request` + `step` to stream. A
    pooling model (an embedding or classification checkpoint, or `runner="pooling"` / `task=...`) runs
    `embed` / `classify` / `score` / `reward` instead (engine/pooling_api.py). `score_choices` /
    `add_choices_request` score candidate continuations of a prompt (engine/choice_scores.py)."""

    def __init__(self, model: str | None = None, **engine_args):
        started = time.perf_counter()
        self._runner: ModelRunner | None = None
        self._workers = None
        self._batch_lock = threading.Lock()  # generate / chat from several threads run one after another
        self._grammar_compiles: GrammarCompileCache | None = None
        self._grammars: GrammarManager | None = None
        self.config = EngineConfig.from_kwargs(**engine_args)
        resolved = resolve_model(model, self.config.load_format, self.config.revision,
                                 self.config.tokenizer)
        self.model_name = resolved.name
        self.hf_config = resolved.hf_config
        # The pooling spec of a pooling model (its task, pooling, outputs), None for a generator.
        self.pooling = resolve_task(self.hf_config, resolved.directory, self.config.runner, self.config.task)
        self.prompts = PromptTokenizer.for_model(resolved, self.pooling)
        self.tokenizer = self.prompts.tokenizer
        try:  # a start that fails stops what it started (the grammar tables' thread, the workers) at once
            if self.tokenizer is not None and self.pooling is None:  # the grammar tables build in the background
                self._grammar_compiles = GrammarCompileCache(self.tokenizer, self.hf_config.vocab_size)
            self.max_model_len = self._max_model_len()
            self._startup_s = {"resolve": time.perf_counter() - started}
            self._workers = start_workers(self.config, resolved, self.max_model_len,  # tensor-parallel ranks 1..N-1
                                          self.pooling)
            with self._workers.build_guard() if self._workers else nullcontext():  # a worker's error, not a broken collective
                self._runner = ModelRunner(self.config, resolved, self.max_model_len, sorted(self._eos_token_ids()),
                                           self.pooling)
        except BaseException:
            self.exit()
            raise
        self._startup_s.update(self._runner.startup_s)
        self._lora = (LoRAManager(self.config.max_loras, self.config.max_lora_rank, self._runner.check_adapter)
                      if self.config.enable_lora else None)
        if self._grammar_compiles is not None:
            self._grammars = GrammarManager(self._grammar_compiles, self._eos_token_ids(), self._runner.max_num_seqs)
        self._outputs = (OutputAssembler(self.tokenizer, self._grammars) if self.pooling is None
                         else PoolingOutputAssembler(self.pooling))
        self._block_manager = BlockManager(self._runner.num_kv_blocks, self.config.block_size,
                                           self.config.enable_prefix_caching, windows=self._runner.kv_groups.windows)
        if self.pooling is not None:
            self._scheduler = PoolingScheduler(self._block_manager, self._runner.max_num_seqs,
                                               self.config.max_num_batched_tokens, self.max_model_len,
                                               self.pooling.pooling, keeps_kv=not self.pooling.encoder)
        else:
            self._scheduler = Scheduler(self._block_manager, self._runner.max_num_seqs,
                                        self.config.max_num_batched_tokens, self.max_model_len, self._eos_token_ids(),
                                        StopStringDetector(self.tokenizer) if self.tokenizer is not None else None,
                                        lora=self._lora, grammars=self._grammars)
        self._loop = StepLoop(self._scheduler,
                              TPRunner(self._runner, self._workers) if self._workers else self._runner,
                              self._new_stats(), self.config.async_scheduling, self._grammars)
        self._seed_rng = random.Random(self.config.seed)
        self._seq_ids = itertools.count()
        self._broken: str | None = None  # why a failed step left the engine unable to run
        self._startup_s["total"] = time.perf_counter() - started

    def _max_model_len(self) -> int:
        limit = self.hf_config.max_position_embeddings if self.pooling is None else self.pooling.max_input_len
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"engine argument max_model_len={self.config.max_model_len} exceeds the model's "
                             f"{'max_position_embeddings' if self.pooling is None else 'longest input'}={limit}")
        return self.config.max_model_len

    def _eos_token_ids(self) -> set[int]:
        ids = self.hf_config.eos_token_id
        eos = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    # ---- request-level API -------------------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.prompts.tokenize(prompt)

    def apply_chat_template(self, conversation: list[dict]) -> list[int]:
        return self.prompts.apply_chat_template(conversation)

    def add_request(self, prompt: Prompt, params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue one request; raises ValueError (and queues nothing) when the request is invalid or can never fit.
        A pooling model's request takes PoolingParams (or None: the model's task). `lora_request`: the LoRA
        adapter a generated request runs with (an engine made with enable_lora=True; None: the base model)."""
        self._check_usable()
        if self.pooling is not None or isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request applies to generated requests, not to pooling ones")
            return self._add_pooling_request(prompt, params, request_id, prompt_token_ids)
        if lora_request is not None:
            if self._lora is None:
                raise ValueError("lora_request needs an engine made with enable_lora=True")
            self._lora.validate(lora_request)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        params.validate()  # again: fields may have been changed since construction
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab_size = self._runner.vocab_size
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            if any(t >= vocab_size for t in getattr(params, name) or ()):
                raise ValueError(f"SamplingParams.{name}: token ids must be below the vocabulary size {vocab_size}")
        seq_id = next(self._seq_ids)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        count = params.best_of or params.n
        user_params = params
        if count > params.n and params.logprobs is None:  # best_of ranks by cumulative logprob
            params = dataclasses.replace(params, logprobs=0)
        seq = Sequence(seq_id, str(seq_id) if request_id is None else request_id, token_ids, params, seed,
                       prompt if isinstance(prompt, str) else None, lora_request)
        if params.bad_words:
            seq.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        error = self._scheduler.capacity_error(seq)
        if error:
            raise ValueError(error)
        seqs = [seq]
        for index in range(1, count):  # siblings share the prompt's blocks once it is computed (BlockManager.fork)
            child = Sequence(next(self._seq_ids), seq.request_id, token_ids, params, (seed + index) % 2**63,
                             seq.prompt, lora_request)
            child.parent, child.completion_index = seq, index
            child.bad_words_token_ids = seq.bad_words_token_ids
            seqs.append(child)
        if count > 1:
            self._outputs.add_group(user_params, seqs)
        for s in seqs:
            if params.structured_outputs is not None:  # compiles in the background; admission waits for it
                s.grammar_future = self.grammar_compile_cache().request(params.structured_outputs)
            self._scheduler.add(s)
        return seq.request_id

    def grammar_compile_cache(self) -> GrammarCompileCache:
        """The engine's structured-output compiles (docs/STRUCTURED_OUTPUTS.md)."""
        if self._grammar_compiles is None:
            raise ValueError(f"structured_outputs: model {self.model_name!r} has no tokenizer, so its output cannot "
                             "be constrained")
        return self._grammar_compiles

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word as token ids, alone and after a space (so it is banned at the start of the text and after
        a word), as vLLM does; the spaced form only when it is a different word of the same length."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a model with a tokenizer")
        words_ids = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced) if spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,):
                if len(ids) > HISTORY_WINDOW + 1:
                    raise ValueError(f"SamplingParams.bad_words: {quoted(word)} is {len(ids)} tokens, more than "
                                     f"{HISTORY_WINDOW + 1}")
                words_ids.append(ids)
        return words_ids

    def has_unfinished_requests(self) -> bool:
        return self._loop.has_work()

    def step(self) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """One iteration of the step loop; returns the requests that finished in it. Raises StepFailedError
        when the step fails: every unfinished request is then aborted, and the engine is left clean or unusable,
        never in between; TPWorkerError when a tensor-parallel worker died or raised (the engine is stopped)."""
        self._check_usable()
        started = time.perf_counter()
        try:
            finished = self._loop.step()
        except TPWorkerError:  # the workers are stopped: the engine cannot run again, and this says why
            self._loop.abort_all()
            self._outputs.clear()
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it was, no half-done step may stay behind
            raise self._abort_after(exc) from exc
        detokenize_started = time.perf_counter()
        outputs = self._outputs.assemble(finished, self.stats)
        ended = time.perf_counter()
        self.stats.detokenize_s += ended - detokenize_started
        self.stats.record_interval(started, ended)
        return outputs

    def _abort_after(self, failure: Exception) -> StepFailedError:
        request_ids = list(dict.fromkeys(seq.request_id for seq in self._loop.abort_all()))
        self._outputs.clear()
        self._broken = "tensor-parallel workers may be mid-step" if self._workers else self._runner.device_error()
        if self._broken:
            self._broken = f"a step failed ({type(failure).__name__}: {failure}) and {self._broken}"
        return StepFailedError(failure, request_ids, engine_usable=self._broken is None)

    def _check_usable(self) -> None:
        if self._runner.released:
            raise RuntimeError("this LLM was exited; make a new one")
        if self._broken:
            raise RuntimeError(f"this LLM cannot run any more: {self._broken}; exit it and make a new one")

    @property
    def stats(self) -> EngineStats:
        return self._loop.stats

    def _new_stats(self) -> EngineStats:
        return EngineStats(device=self._runner.device.type, overlap=self.config.async_scheduling)

    def reset_stats(self) -> None:
        """Start a new measurement (e.g. after a warm-up)."""
        self._loop.stats = self._new_stats()

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch between the sync and the async loop (between jobs: no request may be in flight)."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot switch the step loop while requests are running")
        self.config.async_scheduling = enabled
        self._loop.overlap = enabled
        self.reset_stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, e.g. so that a benchmark's second pass starts cold."""
        self._block_manager.reset_prefix_cache()

    @property
    def info(self) -> EngineInfo:
        """What this engine is: model, device, dtype, KV cache, batch limits and a roofline cost model."""
        runner, config = self._runner, self.config
        return EngineInfo(
            model=self.model_name, vocab_size=self.hf_config.vocab_size, device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
            tensor_parallel_size=config.tensor_parallel_size, attention_backend=runner.attention_backend,
            max_model_len=self.max_model_len, max_num_seqs=runner.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, block_size=config.block_size,
            num_kv_blocks=runner.num_kv_blocks, kv_block_bytes=runner.kv_block_bytes,
            max_batch_size=runner.max_batch_size, decode_batch_sizes=runner.decode_batch_sizes,
            cuda_graphs=runner.graphs is not None, prefix_caching=config.enable_prefix_caching,
            quantization=runner.fp8.name if runner.fp8 is not None else None,
            costs=model_costs(self.hf_config, runner.model, runner.kv_cache_dtype), startup_s=dict(self._startup_s),
            max_loras=config.max_loras if config.enable_lora else 0,
            max_lora_rank=config.max_lora_rank if config.enable_lora else 0, pooling=self.pooling)

    def report(self) -> dict:
        """`get_stats()`, `get_metrics()` and live token counters in one dict: {"steps", "kv_cache", "tokens"}."""
        stats = self.stats
        # Every decode token yields one output token; a request's first output token comes from its prefill.
        tokens = {"prefill": stats.prefill_tokens,
                  "generated": stats.decode_tokens + stats.requests if self.pooling is None else 0}
        return {"steps": self.get_stats(), "kv_cache": self.get_metrics(), "tokens": tokens}

    def get_stats(self) -> dict:
        """Timing and throughput of the steps run since the engine started or `reset_stats`."""
        return self.stats.summary()

    # ---- batch API -----------------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. An invalid prompt gets an output with `error` set; the rest run.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run_batch([(p, None) for p in prompts], sampling_params, lora_request)

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Like `generate`, each conversation rendered through the tokenizer's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        items = []
        for conversation in conversations:
            try:
                items.append((None, self.apply_chat_template(conversation)))
            except ValueError as exc:
                items.append((exc, None))
        return self._run_batch(items, sampling_params, lora_request)

    def _run_batch(self, items: list[tuple], sampling_params, lora_requests) -> list[RequestOutput]:
        if self.pooling is not None:
            raise ValueError(f"model {self.model_name!r} runs as a pooling model (task {self.pooling.task!r}): use "
                             "LLM.embed / classify / score / reward")
        with self._batch_lock:  # a batch collects every output the engine gives: one batch at a time
            return self._run_one_batch(items, sampling_params, lora_requests)

    def _run_one_batch(self, items: list[tuple], sampling_params, lora_requests) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(items)
        if len(sampling_params) != len(items):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(items)} prompts")
        if not isinstance(lora_requests, list):
            lora_requests = [lora_requests] * len(items)
        if len(lora_requests) != len(items):
            raise ValueError(f"got {len(lora_requests)} LoRA requests for {len(items)} prompts")
        outputs: dict[str, RequestOutput] = {}
        request_ids = []
        for index, ((prompt, token_ids), params, lora) in enumerate(zip(items, sampling_params, lora_requests)):
            request_id = f"batch-{next(self._seq_ids)}"
            request_ids.append(request_id)
            try:
                if isinstance(prompt, Exception):
                    raise prompt
                self.add_request(prompt, params, request_id, prompt_token_ids=token_ids, lora_request=lora)
            except ValueError as exc:
                outputs[request_id] = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, [],
                                                    None, [], "error", 0, 0, error=f"prompt {index}: {exc}")
        while self.has_unfinished_requests():
            for output in self.step():
                outputs[output.request_id] = output
        return [outputs[r] for r in request_ids]

    def get_metrics(self) -> dict:
        stats = self._block_manager.stats
        return {
            "num_kv_blocks": self._block_manager.num_blocks,
            "block_size": self._block_manager.block_size,
            "kv_cache_usage": self._block_manager.usage,
            "num_preemptions": self._scheduler.num_preemptions,
            "prefix_cache": {
                "lookups": stats.lookups, "queried_tokens": stats.queried_tokens, "hit_tokens": stats.hit_tokens,
                "hit_rate": stats.hit_rate, "shared_blocks": stats.shared_blocks,
                "resurrected_blocks": stats.resurrected_blocks, "evictions": stats.evictions,
            },
        }

    def exit(self) -> None:
        """Release the engine now: stop the tensor-parallel workers and free the device memory (weights, KV
        cache, CUDA graphs). Dropping the last reference to the LLM frees the same, at once (no reference cycle
        keeps an engine alive)."""
        if self._workers is not None:
            self._workers.shutdown()
        if self._grammars is not None:
            self._grammars.shutdown()
        if self._grammar_compiles is not None:
            self._grammar_compiles.shutdown()
        if self._runner is not None:
            self._runner.release()

    def __del__(self) -> None:
        # Dropping the last reference frees the device memory now, as exit() does, not at some later collection.
        if not sys.is_finalizing():
            self.exit()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.exit()
