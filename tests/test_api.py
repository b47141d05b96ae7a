import gc
import weakref

import pytest

from nanovllm import LLM, SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqz=3), "unknown engine argument"),
    (dict(block_size=24), "power of two"),
    (dict(max_num_seqs=0), "positive integer"),
    (dict(dtype="float8"), "dtype"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(load_format="pt"), "load_format"),
    (dict(fused_ops="yes"), "fused_ops"),
    (dict(tensor_parallel_size=3), "does not divide the model's num_attention_heads=4"),
    (dict(seed=2**64), r"seed=18446744073709551616: must be an integer in \[-2\*\*63"),
    (dict(seed=-2**63 - 1), "seed="),
])
def test_invalid_engine_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny-qwen3", **kwargs)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="neither a .gguf file"):
        LLM("no-such-model")


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(top_p=0), dict(top_k=-5), dict(min_p=2), dict(max_tokens=0), dict(stop=[""]),
    dict(stop_token_ids=[-1]), dict(seed="x"),
])
def test_invalid_sampling_params_raise_value_error(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kwargs)


def test_kv_budget_below_one_sequence_says_what_to_change():
    with pytest.raises(ValueError, match="lower max_model_len"):
        LLM("tiny-qwen3", num_kv_blocks=4, block_size=16, max_model_len=256)


def test_dummy_preset_generates_token_ids_in_order_with_per_prompt_errors():
    llm = LLM("tiny-qwen3", num_kv_blocks=32, max_model_len=256)
    outputs = llm.generate([[1, 2, 3], "text needs a tokenizer", [], [9] * 300, [4, 5]],
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [3, 0, 0, 0, 3]
    assert outputs[1].finish_reason == "error" and "prompt 1" in outputs[1].error and "tokenizer" in outputs[1].error
    assert "empty" in outputs[2].error
    assert "max_model_len" in outputs[3].error
    assert outputs[0].prompt_token_ids == [1, 2, 3] and outputs[4].prompt_token_ids == [4, 5]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request([1, 10**6])


def test_request_level_api_streams_finished_requests():
    llm = LLM("tiny-qwen3", num_kv_blocks=32, max_model_len=256)
    llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="short")
    llm.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), request_id="long")
    finished_at = {}
    steps = 0
    while llm.has_unfinished_requests():
        steps += 1
        for output in llm.step():
            finished_at[output.request_id] = steps
    assert finished_at == {"short": 2, "long": 5}


@pytest.fixture(scope="module")
def smollm():
    return LLM(None, max_model_len=512, num_kv_blocks=64)


def test_chat_and_generate_text(smollm):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    chat = smollm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy)[0]
    assert "Paris" in chat.text
    plain = smollm.generate("The capital of France is", greedy)[0]
    assert plain.prompt == "The capital of France is" and plain.num_prompt_tokens == len(plain.prompt_token_ids)
    assert plain.text == smollm.tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    bad = smollm.chat([[{"role": "user"}]], greedy)[0]
    assert bad.finish_reason == "error" and "role" in bad.error


def test_stop_string_truncates_text_and_finishes(smollm):
    prompt = "Once upon a time, in a quiet village by the sea,"
    full = smollm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = full.text.index(stop)
    stopped = smollm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_eos(smollm):
    prompt = "Once upon a time, in a quiet village by the sea,"
    full = smollm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    stopped = smollm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == full.token_ids[:first + 1]
    answered = smollm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200))[0]
    assert answered.finish_reason == "stop" and answered.token_ids[-1] == smollm.tokenizer.eos_token_id


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_dropped_engine_is_freed_at_once(async_scheduling):
    """No reference cycle keeps an engine (and so its device memory) alive: dropping the last reference frees it
    without a garbage collection, after it ran steps; `exit()` frees the runner's memory even while referenced."""
    gc.disable()
    try:
        llm = LLM("tiny-qwen3", max_model_len=256, num_kv_blocks=32, async_scheduling=async_scheduling)
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0.7, max_tokens=5, seed=1))
        runner = llm._runner
        kept = [weakref.ref(x) for x in (llm, runner, runner.model, runner.kv_cache, *runner.model.parameters())]
        del llm, runner
        assert all(ref() is None for ref in kept)
    finally:
        gc.enable()
    llm = LLM("tiny-qwen3", max_model_len=256, num_kv_blocks=32)
    gc.disable()
    try:
        kept = [weakref.ref(x) for x in (llm._runner.model, llm._runner.kv_cache, *llm._runner.model.parameters())]
        llm.exit()
        assert all(ref() is None for ref in kept)
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="exited"):
        llm.generate([[1, 2, 3]])


def test_generate_from_two_threads_gives_each_its_own_outputs(monkeypatch):
    """Two threads calling `generate` at once: each gets its own prompts' outputs, exactly those of a call alone
    (greedy); a step that yields the GIL every time makes the calls interleave."""
    import threading
    import time

    llm = LLM("tiny-qwen3", num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {name: [[i + 1, i + 2, i + 3 + offset] for i in range(3)] for name, offset in (("a", 0), ("b", 7))}
    alone = {name: [o.token_ids for o in llm.generate(p, params)] for name, p in prompts.items()}
    step = llm.step

    def yielding_step():
        time.sleep(0.002)
        return step()

    monkeypatch.setattr(llm, "step", yielding_step)
    results, errors = {}, []

    def call(name):
        try:
            results[name] = [o.token_ids for o in llm.generate(prompts[name], params)]
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(name,)) for name in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert results == alone
