"""nanovllm: offline batch LLM inference."""
from nanovllm.engine.llm_engine import LLM, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.tokenization import PromptTokenizer

__version__ = "0.1.0"
__all__ = ["LLM", "PromptTokenizer", "RequestOutput", "SamplingParams", "__version__"]
