import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

PRESETS = Path(__file__).resolve().parent.parent / "core" / "presets"


def save_tiny_hf_model(model_type: str, directory: Path, seed: int = 0) -> Path:
    """A random-weight HF model of a tiny preset's shape, saved as sharded safetensors (the loader's input).

    A wide init spreads the logits so that greedy choices are not near-ties that fp32 rounding could flip."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = json.loads((PRESETS / f"tiny-{model_type}.json").read_text())
    config_dict["initializer_range"] = 0.15
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb them so their loading is tested
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, max_shard_size="200KB")
    return directory


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {t: save_tiny_hf_model(t, root / t) for t in ("qwen3", "qwen2", "llama")}


@pytest.fixture(scope="session")
def smollm_dir():
    from nanovllm.loaders.gguf import gguf_to_hf_dir
    from nanovllm.loaders.resolve import default_model_path

    return gguf_to_hf_dir(default_model_path())
