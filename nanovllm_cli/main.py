"""The `nanovllm` command line. It talks to the engine only through the public Python API."""
from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="nanovllm: offline batch LLM inference.")


@app.callback()
def main() -> None:
    """nanovllm: offline batch LLM inference."""


@app.command()
def run(
    input_path: Path = typer.Argument(..., help="JSONL file of {'id', 'prompt' | 'messages'} rows."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Output JSONL (default: INPUT-stem.results.jsonl)."),
    model: str | None = typer.Option(None, help="Model: HF dir, .gguf file or preset (default: embedded SmolLM2)."),
    max_tokens: int = typer.Option(64, help="Output tokens per row."),
    temperature: float = typer.Option(0.0, help="Sampling temperature (0 = greedy)."),
) -> None:
    """Generate a completion for every row of INPUT."""
    from nanovllm import LLM, SamplingParams

    output = output or input_path.with_name(f"{input_path.stem}.results.jsonl")
    rows = [json.loads(line) for line in input_path.read_text().splitlines() if line.strip()]
    llm = LLM(model)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    chats = [i for i, r in enumerate(rows) if "messages" in r]
    plain = [i for i, r in enumerate(rows) if "messages" not in r]
    results = dict(zip(chats, llm.chat([rows[i]["messages"] for i in chats], params))) if chats else {}
    if plain:
        results.update(zip(plain, llm.generate([rows[i]["prompt"] for i in plain], params)))
    with open(output, "w") as f:
        for i, row in enumerate(rows):
            out = results[i]
            f.write(json.dumps({"id": row.get("id", i), "text": out.text, "finish_reason": out.finish_reason,
                                "error": out.error}) + "\n")
    typer.echo(f"wrote {len(rows)} rows to {output}")
