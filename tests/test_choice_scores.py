"""Scoring choices with a generative model: each candidate continuation's log-probability given the prompt,
summed and per token, against HF transformers' log-softmax of the same sequences (fp32, CPU); the prompt's KV is
shared by the choices (prefix cache hits), and `run` rows with `choices` give one record each."""
import json

import pytest
import torch
from test_cli_run import invoke, write_jsonl

from nanovllm import LLM

PROMPT = list(range(5, 45))  # 40 tokens: two whole 16-token blocks before the last prompt position
CHOICES = [[7, 8, 9], [100], [3, 4, 5, 6, 7], [7, 8, 9, 10]]


def hf_choice_logprobs(directory, prompt: list[int], choices: list[list[int]]) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    scores = []
    with torch.inference_mode():
        for choice in choices:
            logprobs = hf(torch.tensor([prompt + choice])).logits[0].log_softmax(-1)
            scores.append(sum(logprobs[len(prompt) - 1 + k, t].item() for k, t in enumerate(choice)))
    return scores


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_choice_logprobs_match_hf_and_share_the_prompt(tiny_model_dirs, async_scheduling):
    directory = tiny_model_dirs["qwen3"]
    expected = hf_choice_logprobs(directory, PROMPT, CHOICES)
    with LLM(str(directory), block_size=16, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=24,
             async_scheduling=async_scheduling) as llm:
        (first,) = llm.score_choices([PROMPT], [CHOICES])
        (again,) = llm.score_choices([PROMPT], [CHOICES])
    for output in (first, again):
        assert [c.logprob for c in output.choices] == pytest.approx(expected, abs=1e-4)
        assert [c.normalized_logprob for c in output.choices] == pytest.approx(
            [s / len(c) for s, c in zip(expected, CHOICES)], abs=1e-4)
        assert output.best == max(range(4), key=expected.__getitem__)
        assert output.best_normalized == max(range(4), key=lambda i: expected[i] / len(CHOICES[i]))
        assert (output.prompt_token_ids, output.num_prompt_tokens) == (PROMPT, 40)
    # The first choice computes the prompt; the others take its two whole blocks (the third holds the last prompt
    # position, whose logits score the first choice token); a repeated request takes them for every choice.
    assert (first.num_cached_tokens, again.num_cached_tokens) == (3 * 32, 4 * 32)


def test_choices_rows_of_run(text_model, tmp_path):
    from transformers import AutoTokenizer

    directory = text_model
    rows = [{"id": "q", "prompt_token_ids": PROMPT, "choices": ["a b", " c", "d e f"]},
            {"id": "bad", "prompt": "x", "choices": []},
            {"id": "sampled", "prompt_token_ids": PROMPT, "choices": ["a"], "temperature": 0.5}]
    out = tmp_path / "out.jsonl"
    result = invoke("run", write_jsonl(tmp_path / "in.jsonl", rows), "-o", out, "--model", str(directory), "-q")
    assert result.exit_code == 1, result.stderr
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    choice_ids = [tokenizer(c, add_special_tokens=False).input_ids for c in rows[0]["choices"]]
    expected = hf_choice_logprobs(directory, PROMPT, choice_ids)
    record = records["q"]
    assert [c["logprob"] for c in record["choices"]] == pytest.approx(expected, abs=1e-4)
    assert [c["num_tokens"] for c in record["choices"]] == [len(ids) for ids in choice_ids]
    assert record["text"] == rows[0]["choices"][record["best"]] and record["completion_tokens"] == 0
    assert "'choices' must be a non-empty array" in records["bad"]["error"]
    assert "temperature: sampling fields do not apply" in records["sampled"]["error"]
