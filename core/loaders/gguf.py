"""GGUF files are converted once, through transformers' GGUF reader, into a cached HF safetensors directory
(config, weights, tokenizer with its chat template) keyed by the file's content hash."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import xxhash

from nanovllm.loaders.integrity import check_gguf


def cache_root() -> Path:
    return Path(os.environ.get("NANOVLLM_CACHE", Path.home() / ".cache" / "nanovllm"))


def file_digest(path: Path, chunk_bytes: int = 1 << 24) -> str:
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def gguf_to_hf_dir(path: Path) -> Path:
    """The cached HF directory for `path`, converting it first if this file was never seen."""
    target = cache_root() / "gguf" / f"{path.stem}-{file_digest(path)}"
    if (target / "model.safetensors").exists():
        return target
    check_gguf(path)  # a truncated file: one error naming it, not the converter's
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # only tells the reader the HF tensor names
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(staging / "model.safetensors"))
        os.replace(staging, target)  # atomic: a concurrent or interrupted conversion never leaves half a cache
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
