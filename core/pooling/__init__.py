"""Pooling models' math and task: pooling methods over a flat token batch (also chunk by chunk), the outputs
(embeddings, classifier probabilities), and which task a checkpoint runs."""
from nanovllm.pooling.methods import PoolingMethod, PoolingState, chunk_partials, pool_sequences
from nanovllm.pooling.outputs import activate, check_dimensions, classifier_activation, embedding_output, labels_of
from nanovllm.pooling.request import row_pooling
from nanovllm.pooling.st_config import SentenceTransformersConfig, read_sentence_transformers_config
from nanovllm.pooling.task import RUNNERS, TASKS, PoolingSpec, resolve_task

__all__ = ["PoolingMethod", "PoolingState", "chunk_partials", "pool_sequences", "activate", "check_dimensions",
           "classifier_activation", "embedding_output", "labels_of", "SentenceTransformersConfig",
           "read_sentence_transformers_config", "RUNNERS", "TASKS", "PoolingSpec", "resolve_task", "row_pooling"]
