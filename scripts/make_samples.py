"""Derive samples/prompts.parquet and samples/openai_batch.jsonl from samples/prompts.jsonl (same rows).

    .venv/bin/python scripts/make_samples.py
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def openai_line(row: dict, max_tokens: int = 64) -> dict:
    """A chat row becomes a /v1/chat/completions request, a plain prompt a /v1/completions one."""
    if "messages" in row:
        url, body = "/v1/chat/completions", {"messages": row["messages"]}
    else:
        url, body = "/v1/completions", {"prompt": row["prompt"]}
    body = {"model": "SmolLM2-135M-Instruct", **body, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": row["id"], "method": "POST", "url": url, "body": body}


def main() -> None:
    rows = [json.loads(line) for line in (SAMPLES / "prompts.jsonl").read_text().splitlines() if line.strip()]
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()),
                        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), SAMPLES / "prompts.parquet", compression="zstd")
    lines = [json.dumps(openai_line(row)) + "\n" for row in rows]
    (SAMPLES / "openai_batch.jsonl").write_text("".join(lines))


if __name__ == "__main__":
    main()
