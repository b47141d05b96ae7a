"""Engine-level penalties and logit controls against HF transformers' logits processors (greedy, tiny Qwen3).

The reference decodes greedily with a full HF forward per token, the HF processors (repetition penalty,
min-new-tokens, sequence bias for logit_bias) and, by hand, OpenAI's presence/frequency formula and an
allowed-token mask, in vLLM's order. The engine must give the same tokens in the sync and the async loop, in a
batch mixed with rows that have no controls."""
import pytest
import torch
from reference import load_hf_model
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from nanovllm import LLM, SamplingParams

PROMPTS = [[200, 201, 202, 5, 6, 7], [30, 31, 32], list(range(100, 140)), [9, 9, 9, 9]]
MAX_NEW = 14


@torch.inference_mode()
def hf_controlled_greedy(model, prompt: list[int], params: SamplingParams, stop_ids: list[int]) -> list[int]:
    ids = list(prompt)
    processors = []
    if params.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stop_ids))
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias.items()}))
    if params.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    generated: list[int] = []
    for _ in range(params.max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[:, -1].float()
        if params.allowed_token_ids:
            mask = torch.full_like(logits, float("-inf"))
            mask[:, params.allowed_token_ids] = 0
            logits = logits + mask
        input_ids = torch.tensor([ids])
        for processor in processors:
            logits = processor(input_ids, logits)
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=logits.shape[1]).float()
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        token = int(logits.argmax())
        generated.append(token)
        ids.append(token)
        if token in params.stop_token_ids:
            break
    return generated


CONTROLS = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition-below-1": dict(repetition_penalty=0.6),
    "presence-frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "negative-presence": dict(presence_penalty=-2.0),
    "logit-bias": dict(logit_bias={17: 8.0, 42: 6.5, 300: -100.0}),
    "allowed": dict(allowed_token_ids=[11, 12, 13, 50, 51, 400]),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={17: 3.0}),
}


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dirs):
    return load_hf_model(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    return {mode: LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=64, block_size=16,
                      max_num_batched_tokens=16, async_scheduling=mode == "async") for mode in ("sync", "async")}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("control", CONTROLS)
def test_controls_match_hf(control, mode, engines, tiny_hf):
    controlled = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **CONTROLS[control])
    plain = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    # rows 0 and 2 controlled, 1 and 3 not: the plain rows must equal plain HF greedy
    params = [controlled, plain, controlled, plain]
    outputs = engines[mode].generate(PROMPTS, params)
    for prompt, p, output in zip(PROMPTS, params, outputs):
        assert output.token_ids == hf_controlled_greedy(tiny_hf, prompt, p, []), f"prompt {prompt[:4]}"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_min_tokens_holds_back_stop_tokens(mode, engines, tiny_hf):
    llm = engines[mode]
    first = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    # the unconstrained first token is a stop token: without min_tokens the output ends at once
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[first],
                            min_tokens=4)
    output = llm.generate([PROMPTS[1]], params)[0]
    assert output.token_ids == hf_controlled_greedy(tiny_hf, PROMPTS[1], params, [first])
    assert len(output.token_ids) >= 4
    if output.finish_reason == "stop":
        assert output.stop_reason == first


def test_seeded_penalised_sampling_is_the_same_in_both_loops(engines):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, frequency_penalty=1.2,
                            repetition_penalty=1.4)
    sync, async_ = (engines[mode].generate(PROMPTS, params) for mode in ("sync", "async"))
    assert [o.token_ids for o in sync] == [o.token_ids for o in async_]


def test_logprobs_stay_raw_under_controls(engines, tiny_hf):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={17: 50.0}, logprobs=1)
    output = engines["sync"].generate([PROMPTS[0]], params)[0]
    assert output.token_ids == [17] * 6
    with torch.inference_mode():
        logits = tiny_hf(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    assert output.logprobs[0][17].logprob == pytest.approx(float(torch.log_softmax(logits, -1)[17]), abs=1e-4)


def test_out_of_vocab_token_ids_are_rejected_by_field(engines):
    for field, value in (("logit_bias", {10**6: 1.0}), ("allowed_token_ids", [10**6])):
        with pytest.raises(ValueError, match=field):
            engines["sync"].add_request([1, 2], SamplingParams(**{field: value}))


def test_rows_release_their_controls(engines):
    llm = engines["sync"]
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.5, logit_bias={3: 1.0}))
    assert llm._runner.persistent.controls.num_rows > 0  # rows are released with the next batch
    llm.generate([[5]], SamplingParams(temperature=0, max_tokens=2))
    controls = llm._runner.persistent.controls
    assert controls.num_rows == 0 and not controls.bias.live and controls.bias.tensors() is None


@pytest.fixture(scope="module")
def smollm():
    return LLM(None, max_model_len=256, num_kv_blocks=32)


def test_stop_reason_and_include_stop_str(smollm):
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = smollm.generate([prompt], greedy)[0].text
    stop = text.strip().split()[2]  # a word the greedy output reaches
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    cut, kept = smollm.generate([prompt] * 2, [params, SamplingParams(**{**params.__dict__,
                                                                        "include_stop_str_in_output": True})])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[:text.index(stop)]
    assert kept.stop_reason == stop and kept.text == text[:text.index(stop) + len(stop)]
    eos = smollm.tokenizer.eos_token_id
    stopped = smollm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[eos],
                                                       logit_bias={eos: 100.0}))[0]
    assert stopped.token_ids == [eos] and stopped.stop_reason == eos
    by_eos = smollm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logit_bias={eos: 100.0}))[0]
    assert by_eos.finish_reason == "stop" and by_eos.stop_reason is None


def test_skip_special_tokens(smollm):
    eos = smollm.tokenizer.eos_token_id
    forced = dict(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={eos: 100.0})
    skipped, kept = smollm.generate(["Hi"] * 2, [SamplingParams(**forced),
                                                 SamplingParams(**forced, skip_special_tokens=False)])
    assert skipped.token_ids == kept.token_ids == [eos, eos]
    assert skipped.text == "" and kept.text == smollm.tokenizer.eos_token * 2


def test_bad_words_match_hf(smollm, smollm_dir):
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    tokenizer = smollm.tokenizer
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    words = smollm.generate([prompt], greedy)[0].text.split()[:2]  # words the greedy output says
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=words)
    for mode in ("sync", "async"):
        smollm.set_async_scheduling(mode == "async")
        output = smollm.generate([prompt], params)[0]
        reference_model = load_hf_model(smollm_dir)
        bad_ids = [tokenizer.encode(prefix + w, add_special_tokens=False) for w in words for prefix in ("", " ")]
        processor = NoBadWordsLogitsProcessor(bad_ids, eos_token_id=None)
        ids = tokenizer(prompt).input_ids
        expected = []
        with torch.inference_mode():
            for _ in range(10):
                logits = reference_model(input_ids=torch.tensor([ids])).logits[:, -1].float()
                token = int(processor(torch.tensor([ids]), logits).argmax())
                expected.append(token)
                ids.append(token)
        assert output.token_ids == expected
        for word_ids in bad_ids:
            assert not any(output.token_ids[i:i + len(word_ids)] == word_ids for i in range(len(output.token_ids)))
    smollm.set_async_scheduling(False)


def test_bad_words_need_a_tokenizer_and_a_bounded_length(engines, smollm):
    with pytest.raises(ValueError, match="bad_words needs a model with a tokenizer"):
        engines["sync"].add_request([1, 2], SamplingParams(bad_words=["x"]))
    with pytest.raises(ValueError, match="SamplingParams.bad_words"):
        smollm.add_request("hi", SamplingParams(bad_words=["supercalifragilistic expialidocious " * 3]))
    with pytest.raises(ValueError, match="SamplingParams.bad_words="):
        SamplingParams(bad_words=["  "])


def test_penalties_survive_preemption(tiny_model_dirs, tiny_hf):
    # 10 blocks of 16 tokens for four sequences of up to 80 tokens: preempted rows refill their token history
    # from the host's tokens on readmission.
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=160, num_kv_blocks=10, block_size=16,
              async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.6,
                            frequency_penalty=0.4)
    outputs = llm.generate(PROMPTS, params)
    assert llm.get_metrics()["num_preemptions"] > 0
    for prompt, output in zip(PROMPTS, outputs):
        assert output.token_ids == hf_controlled_greedy(tiny_hf, prompt, params, [])
