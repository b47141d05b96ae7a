from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanovllm.structured.params import StructuredOutputsParams

_INT64 = (-(1 << 63), (1 << 63) - 1)
_FLOAT32_MAX = 3.4028234663852886e38


def _is_int64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]


def _is_float32(value: object) -> bool:
    """A finite number that float32 holds without overflowing to infinity (the sampler's dtype)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) <= _FLOAT32_MAX)


@dataclass
class SamplingParams:
    """Per-request decoding settings; names and meanings follow vLLM.

    temperature 0 means greedy. top_k <= 0 or top_k = -1 disables top-k; top_p = 1 and min_p = 0 disable theirs.
    A request without a seed gets one drawn from the engine's generator, so every request is reproducible from
    the engine seed, and a seeded request gives the same tokens whatever else is in the batch.
    `structured_outputs` constrains the output (a JSON schema, any JSON object, a regex, a choice, an EBNF
    grammar; docs/STRUCTURED_OUTPUTS.md): a StructuredOutputsParams, or a dict of its fields.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"SamplingParams.{name}={value!r}: must be a list")
            setattr(self, name, list(value or []))
        self.validate()

    def validate(self) -> None:
        """Every field of a type and range the engine can hold (int64 integers, finite float32 numbers): a
        request that passes cannot fail inside a step."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not _is_float32(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_int64(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "must be a positive integer (at most 2**63 - 1), or -1/0 to disable")
        if not _is_float32(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]")
        if not _is_float32(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be a number in [0, 1]")
        if not _is_int64(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer in [1, 2**63 - 1]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if not all(_is_int64(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers in [0, 2**63 - 1]")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be True or False")
        if self.seed is not None and not _is_int64(self.seed):
            raise bad("seed", "must be an integer in [-2**63, 2**63 - 1] or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams, a dict of its fields, or None")
