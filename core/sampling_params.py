from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanovllm.quoting import quoted
from nanovllm.structured.params import StructuredOutputsParams

_INT64 = (-(1 << 63), (1 << 63) - 1)
_FLOAT32_MAX = 3.4028234663852886e38


def is_int64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]


def _is_float32(value: object) -> bool:
    """A finite number that float32 holds without overflowing to infinity (the sampler's dtype)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and abs(value) <= _FLOAT32_MAX)
MAX_LOGPROBS = 20  # the most top-k alternatives `logprobs` / `prompt_logprobs` may ask for (vLLM's default cap)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's cap)
MAX_ALLOWED_TOKEN_IDS = 100_000  # entries of allowed_token_ids
MAX_N = 128  # completions per prompt (n, best_of)
MAX_BAD_WORDS = 100  # entries of bad_words


@dataclass
class SamplingParams:
    """Per-request decoding settings; names and meanings follow vLLM.

    temperature 0 means greedy. top_k <= 0 or top_k = -1 disables top-k; top_p = 1 and min_p = 0 disable theirs.
    A request without a seed gets one drawn from the engine's generator, so every request is reproducible from
    the engine seed, and a seeded request gives the same tokens whatever else is in the batch.
    `structured_outputs` constrains the output (a JSON schema, any JSON object, a regex, a choice, an EBNF
    grammar; docs/STRUCTURED_OUTPUTS.md): a StructuredOutputsParams, or a dict of its fields.

    `logprobs = k` returns, for each generated token, its logprob and rank and the k most likely tokens with
    theirs; `prompt_logprobs = k` the same for every prompt token after the first. Both are logprobs of the
    model's raw distribution (log_softmax of the logits before temperature or any filter), k in [0, MAX_LOGPROBS].
    A request with `prompt_logprobs` takes no prefix-cache hits: its whole prompt is computed, so every position
    has logits.

    Penalties and logit controls (vLLM's semantics, applied on the device before temperature and the filters,
    in this order): `allowed_token_ids` (every other token is banned), `min_tokens` (EOS — unless ignore_eos —
    and stop_token_ids are banned until that many tokens are out; stop strings are not checked before either),
    `logit_bias` ({token id: bias in [-100, 100]} added to the logit), `repetition_penalty` (> 0; a token seen in
    the prompt or the output has a positive logit divided by it, a negative one multiplied), then OpenAI's
    `frequency_penalty` and `presence_penalty` (in [-2, 2]; logit -= frequency * count + presence * (count > 0)
    over output tokens). `bad_words` (strings; each tokenized with and without a leading space, as vLLM): the
    last token of a word is banned when the output ends with the rest of it (applied after allowed_token_ids).
    `include_stop_str_in_output` keeps the stop string in the text; `skip_special_tokens` (default True) drops
    special tokens from the text.

    `n` completions per prompt share its prefill (see BlockManager.fork); completion i draws with seed + i.
    `best_of` (>= n) generates that many and keeps the n with the highest cumulative logprob.
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
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"SamplingParams.{name}={quoted(value)}: must be a list")
            setattr(self, name, list(value or []))
        self.validate()

    def validate(self) -> None:
        """Every field of a type and range the engine can hold (int64 integers, finite float32 numbers): a
        request that passes cannot fail inside a step."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={quoted(getattr(self, name))}: {why}")

        if not _is_float32(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not is_int64(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", "must be a positive integer (at most 2**63 - 1), or -1/0 to disable")
        if not _is_float32(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]")
        if not _is_float32(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be a number in [0, 1]")
        if not is_int64(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer in [1, 2**63 - 1]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if not all(is_int64(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers in [0, 2**63 - 1]")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be True or False")
        if self.seed is not None and not is_int64(self.seed):
            raise bad("seed", "must be an integer in [-2**63, 2**63 - 1] or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams, a dict of its fields, or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        self._validate_controls(bad)

    def _validate_controls(self, bad) -> None:
        number = _is_float32

        def token_id(value) -> bool:
            return is_int64(value) and value >= 0

        if not number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be a finite number in [-2, 2]")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or not (
                0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must be a dict of at most {MAX_LOGIT_BIAS} token ids to biases")
            if not all(token_id(t) and number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
                raise bad("logit_bias", "keys must be token ids (integers >= 0), values finite numbers in [-100, 100]")
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                    or len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS):
                raise bad("allowed_token_ids", f"must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids")
            if not all(token_id(t) for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must hold token ids (integers >= 0)")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.best_of is not None and (not isinstance(self.best_of, int) or isinstance(self.best_of, bool)
                                         or not self.n <= self.best_of <= MAX_N):
            raise bad("best_of", f"must be None or an integer in [n, {MAX_N}]")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS
                or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise bad("bad_words", f"must be a list of at most {MAX_BAD_WORDS} non-blank strings")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")

