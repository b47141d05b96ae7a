"""`core/` must install as `nanovllm` and `kernels/` as `nanovllm.kernels`: never a top-level `core` or `kernels`."""
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pip(*args):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
                   check=True, cwd=ROOT)


def test_regular_install_has_no_top_level_core_or_kernels(tmp_path):
    target = tmp_path / "site"
    _pip("--target", str(target), str(ROOT))
    top = {p.name for p in target.iterdir()}
    assert {"nanovllm", "nanovllm_cli"} <= top
    assert not {"core", "kernels"} & top
    assert (target / "nanovllm" / "kernels" / "__init__.py").exists()
    assert (target / "nanovllm" / "presets" / "qwen3-0.6b.json").exists()


@pytest.mark.slow
def test_editable_install_maps_only_the_project_packages(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    # The build runs in the new environment: lend it this interpreter's packages (the base setuptools may be old).
    build_env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", "-e", str(ROOT)], check=True, cwd=tmp_path, env=build_env)
    probe = ("import importlib.util as u, nanovllm, nanovllm.kernels, nanovllm_cli; "
             "print(u.find_spec('core') is None, u.find_spec('kernels') is None, nanovllm.__file__)")
    # PYTHONPATH lends torch & co.; .pth files (this interpreter's own editable finder) are not read from it.
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env=build_env)
    core_missing, kernels_missing, location = out.stdout.split()
    assert core_missing == "True" and kernels_missing == "True"
    assert Path(location).parent == ROOT / "core"
