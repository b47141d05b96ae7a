"""Row -> prompt token ids, exactly as the engine tokenizes (chat templates included)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from nanovllm import PromptTokenizer
from nanovllm_cli.readers import iter_rows
from nanovllm_cli.rows import RowError, RowParser, RowRequest


def tokenize_row(request: RowRequest, tokenizer: PromptTokenizer) -> RowRequest | RowError:
    """Fill `request.token_ids`; a row the tokenizer or chat template rejects becomes a RowError. Whatever goes
    wrong with one row is that row's error, never the job's (PromptTokenizer bounds each prompt's size)."""
    try:
        if request.kind == "messages":
            token_ids = tokenizer.apply_chat_template(request.payload, request.chat_template_kwargs)
        elif isinstance(request.payload, tuple):  # a score row: the engine joins the pairs; its query, for grouping
            token_ids = tokenizer.tokenize(request.payload[0])
        else:
            token_ids = tokenizer.tokenize(request.payload)
    except Exception as exc:  # noqa: BLE001 (the row's problem, never the job's)
        problem = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        return RowError(request.id, request.where, problem, request.endpoint, request.extra)
    request.token_ids = list(token_ids)
    return request


def tokenized_rows(path: Path, fmt: str, parser: RowParser,
                   tokenizer: PromptTokenizer) -> Iterator[RowRequest | RowError]:
    """Every row of a `run` input file, parsed and tokenized as `run` does."""
    for number, raw in iter_rows(path, fmt):
        row = parser.parse(number, raw)
        yield row if isinstance(row, RowError) else tokenize_row(row, tokenizer)
