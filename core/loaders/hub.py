"""Hugging Face Hub model ids (`Qwen/Qwen3-0.6B`) -> a local snapshot folder, through huggingface_hub's cache.

Each host resolves the id into its own cache (`HF_HUB_CACHE` / `HF_HOME`), so a model id works on every node of a
cluster where a local path would have to be copied. Only the files the engine reads are fetched (config,
tokenizer, safetensors; no weights for `load_format="dummy"`). Offline (`HF_HUB_OFFLINE=1`) or when the Hub
cannot be reached, the cached snapshot of the revision is used; absent, the error says how to get it there.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json"]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]


def is_repo_id(model: str) -> bool:
    """Whether `model` is spelled as a Hub repo id "org/name" (by huggingface_hub's rule; a bare "name", which the
    Hub also knows for a few old models, is more often a mistyped path or preset)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if model.startswith((".", "~")) or model.count("/") != 1:
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def offline() -> bool:
    """HF_HUB_OFFLINE as set at import (huggingface_hub reads it then) or now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def snapshot_dir(repo_id: str, revision: str | None, load_format: str, patterns: list[str] | None = None,
                 what: str = "model") -> Path:
    """The local folder of `repo_id` at `revision` (default: main), downloaded into the cache if needed: the files
    a model needs, or those `patterns` name (a LoRA adapter's; `what` names the repository in errors). Raises
    ValueError saying what is missing and how to get it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.file_download import REGEX_COMMIT_HASH

    if patterns is None:
        patterns = CONFIG_FILES + ([] if load_format == "dummy" else WEIGHT_FILES)
    at = f"{what} {repo_id!r} at revision {revision or 'main'!r}"
    no_hub = offline()
    try:
        if revision is not None and REGEX_COMMIT_HASH.fullmatch(revision) and not no_hub:
            # A commit never changes: its cached snapshot needs no Hub (without network, asking it costs ~20 s of
            # retries on every node).
            with contextlib.suppress(LocalEntryNotFoundError):
                return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                              local_files_only=True))
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=no_hub))
    except LocalEntryNotFoundError as exc:  # also a partial snapshot (IncompleteSnapshotError)
        why = "HF_HUB_OFFLINE is set" if no_hub else "the Hugging Face Hub cannot be reached"
        raise ValueError(
            f"{at} is not (completely) in the Hugging Face cache {constants.HF_HUB_CACHE} and {why}: download "
            f"it where there is network (`hf download {repo_id}` with HF_HUB_CACHE pointing at a folder this host "
            f"sees), or pass a local checkpoint folder ({type(exc).__name__})") from None
    except GatedRepoError:
        raise ValueError(f"{at} is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ValueError(f"{what} {repo_id!r} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        kinds = "a local path, a preset" if what == "model" else "a local path"
        raise ValueError(f"{what} {repo_id!r} is neither {kinds} nor a Hub repository (or it is private: set "
                         "HF_TOKEN)") from None
