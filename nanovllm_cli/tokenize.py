"""Row -> prompt token ids, exactly as the engine tokenizes (chat templates included)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from jinja2.exceptions import TemplateError

from nanovllm import PromptTokenizer
from nanovllm_cli.readers import iter_rows
from nanovllm_cli.rows import RowError, RowParser, RowRequest


def tokenize_row(request: RowRequest, tokenizer: PromptTokenizer) -> RowRequest | RowError:
    """Fill `request.token_ids`; a row the tokenizer or chat template rejects becomes a RowError."""
    try:
        if request.kind == "messages":
            token_ids = tokenizer.apply_chat_template(request.payload, request.chat_template_kwargs)
        elif isinstance(request.payload, tuple):  # a score row: the engine joins the pairs; its query, for grouping
            token_ids = tokenizer.tokenize(request.payload[0])
        else:
            token_ids = tokenizer.tokenize(request.payload)
    except (ValueError, TypeError, TemplateError) as exc:  # the row's problem, never the job's
        return RowError(request.id, request.where, str(exc), request.endpoint)
    request.token_ids = list(token_ids)
    return request


def tokenized_rows(path: Path, fmt: str, parser: RowParser,
                   tokenizer: PromptTokenizer) -> Iterator[RowRequest | RowError]:
    """Every row of a `run` input file, parsed and tokenized as `run` does."""
    for number, raw in iter_rows(path, fmt):
        row = parser.parse(number, raw)
        yield row if isinstance(row, RowError) else tokenize_row(row, tokenizer)
