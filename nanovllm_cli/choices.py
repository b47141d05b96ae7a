"""Rows that score choices instead of generating (evaluation jobs): {"id", "prompt" | "messages" |
"prompt_token_ids", "choices": [str, ...]}. Each choice is scored as a continuation of the prompt by the
model's log-probability, summed and per token (`LLM.add_choices_request`); the record is `run`'s plain record with
"text" the best choice (by summed logprob), no completion tokens, and "choices": [{"index", "text", "logprob",
"normalized_logprob", "num_tokens"}], "best", "best_normalized" (indices). A choice's text carries its leading
space where the continuation has one (" Paris")."""
from __future__ import annotations


def choices_fields(choices: list[str], output) -> dict:
    """The record fields of a scored row (`output`: a ChoicesRequestOutput)."""
    scored = [{"index": c.index, "text": choices[c.index], "logprob": c.logprob,
               "normalized_logprob": c.normalized_logprob, "num_tokens": len(c.token_ids)} for c in output.choices]
    return {"text": choices[output.best], "choices": scored, "best": output.best,
            "best_normalized": output.best_normalized}
