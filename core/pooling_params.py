"""What a pooling request asks (`PoolingParams`, vLLM's names), and what the runner applies to one row's pooled
vector once the request is checked against the model (`RowPooling`)."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score", "reward")


@dataclass
class PoolingParams:
    """Per-request settings of a pooling model; names and meanings follow vLLM.

    `task`: embed | classify | score | reward (None: the engine's task; an engine serves the tasks its model
    does, e.g. a one-label classifier classify, score and reward). `dimensions` (embed): keep the first k
    features (Matryoshka models only), then normalize. `normalize` (embed): L2-normalize the vector (None: as the
    model does: its sentence-transformers Normalize module, or always for a model without that config).
    `activation` (classify, score): apply the task's activation (softmax / sigmoid; None or True) or return the
    raw logits (False)."""

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field of its type (a request that passes is checked against the model by the engine)."""
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"PoolingParams.task={self.task!r}: must be one of {', '.join(POOLING_TASKS)} or None")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions={self.dimensions!r}: must be a positive integer or None")
        for name in ("normalize", "activation"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"PoolingParams.{name}={getattr(self, name)!r}: must be True, False or None")


@dataclass(frozen=True)
class RowPooling:
    """What one row's pooled vector becomes on the device: `task` embed -> its first `dimensions` features
    (None: all), L2-normalized where `normalize`; another task -> the model's head (`compute_logits`), then
    `activation` (softmax | sigmoid | none)."""

    task: str
    dimensions: int | None = None
    normalize: bool = False
    activation: str = "none"
