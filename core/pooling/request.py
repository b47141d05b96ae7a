"""A request's `PoolingParams` checked against the model's `PoolingSpec`: what its rows become on the device
(`RowPooling`), or a ValueError naming the field and the fix."""
from __future__ import annotations

from nanovllm.pooling.outputs import check_dimensions
from nanovllm.pooling.task import PoolingSpec
from nanovllm.pooling_params import PoolingParams, RowPooling


def row_pooling(params: PoolingParams, spec: PoolingSpec, hf_config) -> RowPooling:
    """The rule of a request's rows. A score request of an embedder embeds its texts (the engine compares the
    embeddings by the model's similarity); a cross-encoder's scores its pairs."""
    params.validate()
    task = params.task or spec.task
    if task not in spec.tasks:
        raise ValueError(f"PoolingParams.task={task!r}: this model serves {', '.join(spec.tasks)}")
    embeds = spec.model_kind == "embed"
    if task == "embed" or (task == "score" and embeds):
        if params.activation is not None:
            raise ValueError("PoolingParams.activation applies to classify and score by a classifier, not to "
                             "embeddings: leave it unset")
        if task == "score" and (params.dimensions is not None or params.normalize is not None):
            raise ValueError("PoolingParams.dimensions / normalize apply to embed; a score compares whole "
                             "embeddings: leave them unset")
        check_dimensions(params.dimensions, hf_config, spec.output_size)
        return RowPooling("embed", params.dimensions, spec.normalize if params.normalize is None else params.normalize)
    for name in ("dimensions", "normalize"):
        if getattr(params, name) is not None:
            raise ValueError(f"PoolingParams.{name} applies to embed, not to {task}: leave it unset")
    if task == "reward" and params.activation:
        raise ValueError("PoolingParams.activation: a reward is the head's raw output; leave it unset")
    return RowPooling(task, activation="none" if params.activation is False else spec.activation(task))
