"""The async loop reorders the same engine: greedy outputs must equal the sync loop's (docs/ARCHITECTURE.md)."""
import itertools
import time

import pytest
import torch
from helpers import make_seq
from test_engine_hf import CHATS, ENGINE_VARIANTS, TINY_PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def run_both(model, prompts, params, **engine_args):
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(model, async_scheduling=async_scheduling, **engine_args)
        outputs = llm.generate(prompts, params)
        results[async_scheduling] = (outputs, llm)
    return results


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_async_equals_sync_tiny(variant, tiny_model_dirs):
    both = run_both(str(tiny_model_dirs["qwen3"]), TINY_PROMPTS, GREEDY, max_model_len=256, num_kv_blocks=128,
                    **ENGINE_VARIANTS[variant])
    sync_out, async_out = both[False][0], both[True][0]
    assert [o.token_ids for o in async_out] == [o.token_ids for o in sync_out]
    # Hit counts may differ: the async loop commits (and hashes) a step's blocks one iteration later.


def test_async_equals_sync_under_preemption(tiny_model_dirs):
    both = run_both(str(tiny_model_dirs["llama"]), TINY_PROMPTS, GREEDY, max_model_len=160, num_kv_blocks=10)
    assert both[True][1].get_stats()["preemptions"] > 0
    assert [o.token_ids for o in both[True][0]] == [o.token_ids for o in both[False][0]]


def test_async_equals_sync_with_seeded_sampling(tiny_model_dirs):
    params = [SamplingParams(temperature=0.9, top_k=50, max_tokens=15, ignore_eos=True, seed=i) for i in range(6)]
    both = run_both(str(tiny_model_dirs["qwen2"]), TINY_PROMPTS, params, max_model_len=256, num_kv_blocks=128,
                    max_num_batched_tokens=64)
    assert [o.token_ids for o in both[True][0]] == [o.token_ids for o in both[False][0]]


@pytest.fixture(scope="module")
def smollm_pair():
    return {a: LLM(None, max_model_len=512, num_kv_blocks=64, async_scheduling=a) for a in (False, True)}


def test_async_stops_one_step_late_like_sync(smollm_pair):
    """EOS, stop ids, stop strings and max_tokens are known only after the next step is launched: the extra
    token must be discarded and outputs equal the sync loop's."""
    sync_llm, async_llm = smollm_pair[False], smollm_pair[True]
    probe = sync_llm.generate("Once upon a time,", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop_word = probe.text.split()[4]
    cases = [
        ("Once upon a time,", SamplingParams(temperature=0, max_tokens=7)),
        ("Once upon a time,", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[probe.token_ids[3]])),
        ("Once upon a time,", SamplingParams(temperature=0, max_tokens=30, stop=[stop_word])),
        (None, SamplingParams(temperature=0, max_tokens=200)),  # ends with EOS
    ]
    for prompt, params in cases:
        if prompt is None:
            sync_out, async_out = sync_llm.chat(CHATS, params), async_llm.chat(CHATS, params)
        else:
            sync_out, async_out = sync_llm.generate(prompt, params), async_llm.generate(prompt, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in async_out] == \
               [(o.token_ids, o.text, o.finish_reason) for o in sync_out]
    assert any(o.finish_reason == "stop" for o in sync_out)
    assert not async_llm.has_unfinished_requests()
    assert async_llm._block_manager.num_free_blocks == async_llm._block_manager.num_blocks


def test_stats_invariants(smollm_pair):
    for llm in smollm_pair.values():
        llm.reset_stats()
        outputs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        stats = llm.get_stats()
        assert stats["device"] == "cpu" and stats["overlap"] is False
        assert stats["gpu_busy_s"] is None and stats["gpu_busy_frac"] is None and stats["gpu_idle_frac"] is None
        assert stats["requests"] == len(CHATS)
        assert stats["output_tokens"] == sum(len(o.token_ids) for o in outputs)
        assert stats["prompt_tokens"] == sum(o.num_prompt_tokens for o in outputs)
        phases = [stats[k] for k in ("cpu_schedule_s", "cpu_prepare_s", "cpu_execute_s", "cpu_wait_s",
                                     "cpu_postprocess_s")]
        assert all(p >= 0 for p in phases)
        assert sum(phases) <= stats["wall_s"] * 1.001 + 1e-3
        assert stats["output_tok_s"] == pytest.approx(stats["output_tokens"] / stats["wall_s"])
        assert 0 <= stats["ttft_p50_s"] <= stats["ttft_p99_s"] <= stats["wall_s"]
        assert stats["tpot_p50_s"] > 0
        # every chat decodes together after its prefill: the largest decode batch holds all of them
        assert stats["largest_decode_batch"] == len(CHATS)
        assert 0 < stats["host_ms_per_largest_decode_step"] <= 1000 * (stats["cpu_schedule_s"] + stats["cpu_prepare_s"])


def test_wall_clock_includes_the_callers_time_between_steps(smollm_pair):
    """Throughput is over the elapsed time from the first step to the last: a caller's work between steps
    (writing results; the async loop's device keeps running meanwhile) is inside the wall clock, not left out."""
    pause = 0.02
    for llm in smollm_pair.values():
        llm.reset_stats()
        llm.add_request("Once upon a time,", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        calls, between, returned = 0, 0.0, None
        while llm.has_unfinished_requests():
            if returned is not None:
                between += time.perf_counter() - returned
            llm.step()
            returned = time.perf_counter()
            calls += 1
            time.sleep(pause)
        stats = llm.get_stats()
        inside = sum(stats[k] for k in ("cpu_schedule_s", "cpu_prepare_s", "cpu_execute_s", "cpu_wait_s",
                                        "cpu_postprocess_s"))
        # Disjoint spans of the wall clock, each measured on the one host clock: the steps' phases (inside the
        # calls) and the caller's time between the calls (every pause but the last, after the last step).
        assert calls >= 4 and between >= (calls - 1) * pause
        assert stats["wall_s"] >= inside + between - 1e-9
        assert stats["output_tok_s"] == pytest.approx(4 / stats["wall_s"])


# ---- unit tests of the in-flight state -------------------------------------------------------------------------

def test_inflight_prefill_chunks_are_never_rescheduled():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128,
                      eos_token_ids={2})
    seq = make_seq(list(range(10, 30)), max_tokens=4)  # 20 tokens: chunks [0,8) [8,16) [16,20)
    sched.add(seq)
    first = sched.schedule()
    second = sched.schedule()  # step 1 still in flight
    assert (first.start_positions, first.num_new_tokens, first.samples) == ([0], [8], [False])
    assert (second.start_positions, second.num_new_tokens, second.samples) == ([8], [8], [False])
    assert seq.num_computed_tokens == 0 and seq.num_inflight_tokens == 16
    sched.postprocess(first, [0])
    assert seq.num_computed_tokens == 8 and seq.num_inflight_tokens == 8
    third = sched.schedule()
    assert (third.start_positions, third.num_new_tokens, third.samples) == ([16], [4], [True])
    assert seq.num_pending_tokens == 1
    fourth = sched.schedule()  # decode of the token step 3 samples: a pending input
    assert (fourth.start_positions, fourth.num_new_tokens, fourth.pending_inputs) == ([20], [1], [0])
    assert seq.num_pending_tokens == 2 and len(seq.token_ids) + seq.num_pending_tokens == 22
    sched.postprocess(second, [0])
    sched.postprocess(third, [77])
    assert seq.output_token_ids == [77] and seq.num_pending_tokens == 1 and seq.num_computed_tokens == 20


def test_pending_input_reserves_a_slot_and_late_finish_is_discarded():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, eos_token_ids={2})
    seq = make_seq([5, 6, 7, 8], max_tokens=10)
    sched.add(seq)
    prefill = sched.schedule()
    decode = sched.schedule()  # the pending input at position 4 needs a second block
    assert len(seq.block_table) == 2
    sched.postprocess(prefill, [2])  # EOS: finished at step 1 while step 2 is in flight
    assert seq.finish_reason == "stop" and bm.num_free_blocks == 64
    sched.postprocess(decode, [9])  # step 2's extra token is discarded
    assert seq.output_token_ids == [2]
    assert sched.take_finished() == [seq] and not sched.has_unfinished()


def test_max_tokens_known_ahead_is_not_scheduled_again():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                      eos_token_ids={2})
    seq = make_seq([5, 6, 7], max_tokens=1)
    sched.add(seq)
    sched.schedule()
    assert not sched.schedule()  # its only output token is in flight: nothing to compute


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_kv_blocks", [128, 20])
def test_steady_decode_steps_equal_the_full_schedule(async_scheduling, num_kv_blocks, tiny_model_dirs,
                                                     monkeypatch):
    """The scheduler's shortcut for a step that is the previous one advanced (every running sequence decodes)
    must lead to the very steps its full loop builds: same sequences, positions and table growth, and the same
    device inputs (the shortcut's input ids are copied on the device from the previous step's samples),
    including finishes, a request that arrives right after a step that dropped a finished sequence, and (few
    KV blocks) preemptions; and it must serve most steps."""
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30, 9, 44, 23)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (100, 64, 120, 100, 64, 120)]

    def steps(shortcut: bool) -> tuple[list[tuple], int]:
        llm = LLM(str(tiny_model_dirs["qwen3"]), async_scheduling=async_scheduling, max_model_len=256,
                  num_kv_blocks=num_kv_blocks)
        scheduler, runner, seen, served = llm._scheduler, llm._runner, [], []
        steady, prepare = scheduler._schedule_steady_decode, runner.prepare

        def record_steady(plan):
            batch = steady(plan) if shortcut else None
            served.append(batch is not None)
            return batch

        def record_prepare(batch):
            inputs = prepare(batch)
            tensors = [value.tolist() for value in (*vars(inputs).values(), *vars(inputs.sampling).values())
                       if isinstance(value, torch.Tensor)]
            seen.append(([s.seq_id for s in batch.seqs], list(batch.start_positions), batch.num_new_tokens,
                         [s.seq_id for s in batch.table_changed], batch.epochs, tensors))
            return inputs

        monkeypatch.setattr(scheduler, "_schedule_steady_decode", record_steady)
        monkeypatch.setattr(runner, "prepare", record_prepare)
        for prompt, param in zip(prompts, params):
            llm.add_request(prompt, param)
        late_at = None
        for step in itertools.count():
            if not llm.has_unfinished_requests():
                break
            if llm.step() and late_at is None:
                late_at = step + 2  # the step after the finish drops it: the late request finds that one in flight
            if step == late_at:
                llm.add_request(list(range(7, 40)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        assert (llm.get_stats()["preemptions"] > 0) == (num_kv_blocks < 46)  # 46 blocks hold every sequence
        return seen, sum(served)

    with_shortcut, served = steps(True)
    without, _ = steps(False)
    assert with_shortcut == without
    # with room for all, only the prefill steps and the step after the late admission are not steady decodes
    assert served >= (len(without) - 5 if num_kv_blocks == 128 else len(without) / 2)
