"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) through xgrammar.

Per request: `StructuredOutputsParams` (or `from_response_format` for OpenAI lines) -> `GrammarCompileCache.request`
-> `CompileFuture`; once ready, `CompiledConstraint.new_row(stop_ids)` gives each output row a `RowGrammar`.
Per step: `BatchBitmask.prepare(grammars, logits_rows)` -> `StepBitmask.apply(logits)` before sampling, then
`RowGrammar.accept(token)` for each sampled token. docs/STRUCTURED_OUTPUTS.md says how this fits the step loops."""
from __future__ import annotations

import importlib

# Loaded on first use: importing xgrammar takes seconds, and a request without a constraint (SamplingParams imports
# `params`) must not pay it.
_HOME = {
    "BatchBitmask": "batch_bitmask", "StepBitmask": "batch_bitmask",
    "CompileFuture": "compile_cache", "CompiledConstraint": "compile_cache", "ConstraintError": "compile_cache",
    "GrammarCompileCache": "compile_cache",
    "StructuredOutputsParams": "params", "from_response_format": "params",
    "RowGrammar": "row_grammar",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
