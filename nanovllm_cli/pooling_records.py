"""The records of a pooling job (`run --task ...`), one per input row.

Plain: {"id", <the task's fields>, "prompt_tokens", "cached_tokens", "error", "input_fingerprint"} (+
"prompt_token_ids" with --include-token-ids), the task's fields being embed {"embedding": [float, ...]}, classify
{"probs": [float, ...] by label id, "label": the likeliest label's name}, score {"score": float} for a text_1 /
text_2 pair or {"scores": [float, ...]} for a query and its documents, reward {"reward": [float, ...]} (the head's
raw output, one value per label); a failed row has them null and "error" set. In Parquet the embedding is a
fixed_size_list<float32> of the job's size (a row whose vector has another size gets an error record instead).
OpenAI `/v1/embeddings` lines are answered with OpenAI's embeddings response body (records.py wraps it)."""
from __future__ import annotations

TASK_FIELDS = {"embed": ("embedding",), "classify": ("probs", "label"), "score": ("score", "scores"),
               "reward": ("reward",)}
COUNT_FIELDS = ("prompt_tokens", "cached_tokens")


class RecordProblem(ValueError):
    """A row's result that the output cannot hold."""


def pooling_fields(task: str) -> tuple[str, ...]:
    return ("id", *TASK_FIELDS[task], *COUNT_FIELDS, "error", "input_fingerprint")


def arrow_fields(task: str, embedding_size: int | None, include_token_ids: bool) -> list:
    import pyarrow as pa

    vector = pa.list_(pa.float32(), embedding_size) if embedding_size else pa.list_(pa.float32())
    types = {"embedding": vector, "probs": pa.list_(pa.float32()), "score": pa.float64(),
             "scores": pa.list_(pa.float64()), "reward": pa.list_(pa.float32()), "prompt_tokens": pa.int64(),
             "cached_tokens": pa.int64()}
    fields = [(name, types.get(name, pa.string())) for name in pooling_fields(task)]
    return fields + [("prompt_token_ids", pa.list_(pa.int64()))] if include_token_ids else fields


def result_record(task: str, request, output, fingerprint: str | None, embedding_size: int | None,
                  include_token_ids: bool) -> dict:
    """A row's record from its PoolingRequestOutput; RecordProblem when the output cannot hold it."""
    values = dict.fromkeys(TASK_FIELDS[task])
    result = output.outputs
    if task == "embed":
        values["embedding"] = result.embedding
        if embedding_size and len(result.embedding) != embedding_size:
            raise RecordProblem(f"the row's embedding has {len(result.embedding)} dimensions, but a Parquet OUTPUT "
                                f"holds vectors of one size ({embedding_size}): write JSONL, or give every row the "
                                "same dimensions (--dimensions)")
    elif task == "classify":
        values.update(probs=result.probs, label=result.label)
    elif task == "score":
        scores = [s.score for s in result]
        values.update(score=scores[0]) if request.kind == "pair" else values.update(scores=scores)
    else:
        values["reward"] = result.data.tolist()
    record = {"id": request.id, **values, "prompt_tokens": output.num_prompt_tokens,
              "cached_tokens": output.num_cached_tokens, "error": None, "input_fingerprint": fingerprint}
    if include_token_ids:
        record["prompt_token_ids"] = output.prompt_token_ids
    return record


def error_record(task: str, row_id: str, message: str, prompt_tokens: int, fingerprint: str | None,
                 include_token_ids: bool) -> dict:
    record = {"id": row_id, **dict.fromkeys(TASK_FIELDS[task]), "prompt_tokens": prompt_tokens, "cached_tokens": 0,
              "error": message, "input_fingerprint": fingerprint}
    if include_token_ids:
        record["prompt_token_ids"] = None
    return record


def embeddings_body(output, model: str) -> dict:
    """OpenAI's /v1/embeddings response body of one input."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": 0, "embedding": output.outputs.embedding}],
            "usage": {"prompt_tokens": output.num_prompt_tokens, "total_tokens": output.num_prompt_tokens}}
