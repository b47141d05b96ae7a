"""nanovllm: offline batch LLM inference.

The public surface is `__all__`: tools such as `nanovllm_cli` use nothing else (tests/test_public_api.py)."""
from nanovllm.engine.choice_scores import ChoiceScore, ChoicesRequestOutput
from nanovllm.engine.dry_run import (
    KVCachePlan,
    ModelSource,
    PrefixCacheReplay,
    block_hashes,
    check_engine_args,
    model_source,
    plan_kv_cache,
    pooling_spec,
)
from nanovllm.engine.info import CostModel, EngineInfo
from nanovllm.engine.llm_engine import LLM, StepFailedError
from nanovllm.engine.logprob_records import Logprob, PositionLogprobs
from nanovllm.engine.outputs import CompletionOutput, RequestOutput
from nanovllm.engine.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from nanovllm.lora import LoRARequest
from nanovllm.lora.random_adapter import save_random_lora_adapter
from nanovllm.pooling import PoolingSpec
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured.params import StructuredOutputsParams, from_response_format
from nanovllm.tokenization import PromptTokenizer

__version__ = "0.1.0"
__all__ = ["LLM", "ChoiceScore", "ChoicesRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
           "CompletionOutput", "CostModel", "EmbeddingOutput", "EmbeddingRequestOutput", "EngineInfo", "KVCachePlan",
           "LoRARequest", "Logprob", "ModelSource", "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "PoolingSpec",
           "PositionLogprobs", "PrefixCacheReplay", "PromptTokenizer", "RequestOutput", "SamplingParams", "ScoringOutput",
           "ScoringRequestOutput", "StepFailedError", "StructuredOutputsParams", "__version__", "block_hashes",
           "check_engine_args", "from_response_format", "model_source", "plan_kv_cache", "pooling_spec",
           "save_random_lora_adapter"]
