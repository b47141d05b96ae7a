"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) through xgrammar.

`GrammarManager` (one per engine) is the host side: per request `StructuredOutputsParams` (or
`from_response_format` for OpenAI lines) -> a compile on its pool (`GrammarCompileCache`) -> each output row's
`RowGrammar`; per step the rows' accepts and token masks -> a `StepMask`, which the device side applies with
`DeviceMask`. docs/STRUCTURED_OUTPUTS.md says how this fits the step loops."""
from __future__ import annotations

import importlib

# Loaded on first use: importing xgrammar takes seconds, and a request without a constraint (SamplingParams imports
# `params`) must not pay it.
_HOME = {
    "CopyFence": "bitmask", "DeviceMask": "bitmask", "StepMask": "bitmask",
    "CompileFuture": "compile_cache", "CompiledConstraint": "compile_cache", "ConstraintError": "compile_cache",
    "GrammarCompileCache": "compile_cache",
    "UnsupportedSchema": "json_schema", "prepare_schema": "json_schema",
    "GrammarManager": "manager", "StepGrammars": "manager",
    "StructuredOutputsParams": "params", "from_response_format": "params",
    "RowGrammar": "row_grammar",
    "GrammarVocabulary": "vocabulary",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
