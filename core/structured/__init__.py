"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) through xgrammar.

Per request: `StructuredOutputsParams` (or `from_response_format` for OpenAI lines) -> `GrammarCompileCache.request`
-> `CompileFuture`; once ready, `CompiledConstraint.new_row(stop_ids)` gives each output row a `RowGrammar`.
Per step: `BatchBitmask.prepare(grammars, logits_rows)` -> `StepBitmask.apply(logits)` before sampling, then
`RowGrammar.accept(token)` for each sampled token. docs/STRUCTURED_OUTPUTS.md says how this fits the step loops."""
from nanovllm.structured.batch_bitmask import BatchBitmask, StepBitmask
from nanovllm.structured.compile_cache import CompiledConstraint, CompileFuture, ConstraintError, GrammarCompileCache
from nanovllm.structured.params import StructuredOutputsParams, from_response_format
from nanovllm.structured.row_grammar import RowGrammar

__all__ = [
    "BatchBitmask",
    "CompileFuture",
    "CompiledConstraint",
    "ConstraintError",
    "GrammarCompileCache",
    "RowGrammar",
    "StepBitmask",
    "StructuredOutputsParams",
    "from_response_format",
]
