"""Turn the user's `model` argument into a config, a weight source and a tokenizer source."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nanovllm.loaders.default_model import default_model_path

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"


@dataclass
class ResolvedModel:
    name: str
    hf_config: object
    weights_dir: Path | None  # None: random (dummy) weights
    tokenizer_dir: Path | None  # None: token ids in and out only
    gguf: bool = False  # the weights come from a GGUF file (converted)
    directory: Path | None = None  # the checkpoint's folder (its sentence-transformers files), dummy weights or not
    preset: bool = False  # a model shape of presets/ (random weights, no tokenizer of its own)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / f).exists() for f in TOKENIZER_FILES)


def resolve_tokenizer(tokenizer: str) -> Path:
    """The folder of a tokenizer given apart from the model (vLLM's `tokenizer`): a local folder, or a Hub id
    whose tokenizer files alone are fetched. Raises ValueError naming what is wrong."""
    from nanovllm.loaders import hub

    path = Path(tokenizer).expanduser()
    if path.is_dir():
        directory = path
    elif not path.exists() and hub.is_repo_id(tokenizer):
        directory = hub.snapshot_dir(tokenizer, None, "dummy", patterns=list(hub.CONFIG_FILES), what="tokenizer")
    else:
        raise ValueError(f"tokenizer {tokenizer!r} is neither a folder nor a Hugging Face Hub id (org/name)")
    if not _has_tokenizer(directory):
        raise ValueError(f"tokenizer {tokenizer!r}: {directory} holds no tokenizer ({', '.join(TOKENIZER_FILES)})")
    return directory


def resolve_model(model: str | None, load_format: str = "auto", revision: str | None = None,
                  tokenizer: str | None = None) -> ResolvedModel:
    """`model`: a .gguf file, an HF checkpoint folder, a preset, or a Hugging Face Hub id (`revision`: its
    branch, tag or commit; the Hub is asked only for a name that is none of the others). `tokenizer`: a folder
    or Hub id whose tokenizer replaces the model's own (a preset has none)."""
    resolved = _resolve_model(model, load_format, revision)
    if tokenizer is not None:
        resolved.tokenizer_dir = resolve_tokenizer(tokenizer)
    return resolved


def _resolve_model(model: str | None, load_format: str, revision: str | None) -> ResolvedModel:
    from transformers import AutoConfig

    from nanovllm.loaders import hub
    from nanovllm.loaders.gguf import gguf_to_hf_dir
    from nanovllm.loaders.integrity import check_checkpoint_files
    from nanovllm.models.registry import check_supported

    if model is None:
        model = str(default_model_path())
    path = Path(model).expanduser()
    local = path.exists() or model in preset_names()
    if revision is not None and local:
        raise ValueError(f"revision={revision!r} applies to Hugging Face Hub model ids, not to {model!r}")
    if path.is_file() and path.suffix == ".gguf":
        directory = gguf_to_hf_dir(path)
    elif path.is_dir():
        directory = path
    elif not local and hub.is_repo_id(model):
        directory = hub.snapshot_dir(model, revision, load_format)
    elif model in preset_names():
        config_dict = json.loads((PRESET_DIR / f"{model}.json").read_text())
        hf_config = AutoConfig.for_model(**config_dict)
        check_supported(hf_config)  # an unsupported architecture fails here, before tokenizer, workers or weights
        return ResolvedModel(model, hf_config, None, None, preset=True)
    else:
        raise ValueError(f"model {model!r} is neither a .gguf file, an HF checkpoint directory, a preset "
                         f"({', '.join(preset_names())}) nor a Hugging Face Hub id (org/name)")
    if not (directory / "config.json").exists():
        raise ValueError(f"model directory {directory} has no config.json")
    check_checkpoint_files(directory, weights=load_format != "dummy")  # a truncated file: one error naming it
    hf_config = AutoConfig.from_pretrained(str(directory))
    check_supported(hf_config)
    weights = None if load_format == "dummy" else directory
    name = model if not local else path.stem if path.is_file() else path.name
    return ResolvedModel(name, hf_config, weights, directory if _has_tokenizer(directory) else None,
                         gguf=path.is_file(), directory=directory)
