"""Tensor-parallel workers start through multiprocessing's spawn, which imports the main script again in every
worker: a script that builds its LLM at import time (no `if __name__ == "__main__":` guard) would have each worker
try to start workers of its own, and they die in bootstrap with a message only on their stderr."""
from __future__ import annotations

import re
import sys
from pathlib import Path

_GUARD = re.compile(r"""__name__\s*==\s*['"]__main__['"]|['"]__main__['"]\s*==\s*__name__""")


def check_main_guard() -> None:
    """Raise RuntimeError, saying how to fix it, when the main module is a Python file without a main guard."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not path.endswith(".py"):
        return  # an interactive session, `python -c`, a notebook, a console script: nothing is imported again
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    if not _GUARD.search(source):
        raise RuntimeError(
            f"tensor_parallel_size > 1 needs the script {path} to create its LLM under "
            "`if __name__ == \"__main__\":`. The tensor-parallel workers are started with multiprocessing's "
            "spawn, which imports the script again in each worker; without the guard every worker would run the "
            "script's code and try to start workers itself.")
