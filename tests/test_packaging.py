"""`core/` must install as `nanovllm` and `kernels/` as `nanovllm.kernels`: never a top-level `core` or `kernels`.
The dependencies co-install with transformers 4.56+ and 5, and an object-store URL names the extra that reads it."""
import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import fsspec
import pytest
import tomllib
from fsspec.registry import known_implementations
from packaging.requirements import Requirement
from typer.testing import CliRunner

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


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_hub_bound_admits_transformers_4_and_5():
    """transformers 4.56 asks huggingface-hub>=0.34,<1.0, transformers 5 a hub of 1.x or later: ours admits both."""
    ours = next(r for r in map(Requirement, _project()["dependencies"]) if r.name == "huggingface-hub").specifier
    assert ours.contains("0.34.0") and ours.contains("0.36.0")
    installed = next(r for r in map(Requirement, importlib.metadata.requires("transformers"))
                     if r.name == "huggingface-hub" and r.marker is None)
    assert ours.contains(importlib.metadata.version("huggingface-hub")) and installed.specifier.contains(
        importlib.metadata.version("huggingface-hub"))


def test_object_store_urls_name_the_extra_that_reads_them(monkeypatch, tmp_path):
    ray_extra = {Requirement(r).name for r in _project()["optional-dependencies"]["ray"]}
    for protocol in ("s3", "gs"):  # the filesystem package fsspec loads for each is in the [ray] extra
        assert known_implementations[protocol]["class"].split(".")[0] in ray_extra, protocol

    def missing(url, **kwargs):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    from nanovllm_cli.main import app

    result = CliRunner().invoke(app, ["run", "s3://bucket/rows.jsonl", "-o", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr  # one line
    assert "cannot open s3://bucket/rows.jsonl: Install s3fs" in result.stderr
    assert "pip install 'nanovllm[ray]' brings s3fs and gcsfs" in result.stderr
