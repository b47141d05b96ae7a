"""Hugging Face Hub model ids resolve through huggingface_hub's cache, without network.

The cache is laid out as huggingface_hub writes it (models--ORG--NAME/refs/REVISION holding a commit hash,
snapshots/COMMIT/ holding the files); `scan_cache_dir`, huggingface_hub's own reader, checks that layout first.
The Hub is made unreachable by pointing its endpoint at a closed loopback port."""
import json

import huggingface_hub
import pytest
from conftest import PRESETS
from huggingface_hub import constants

from nanovllm import LLM, SamplingParams
from nanovllm.loaders import resolve_model

REPO = "acme/tiny-llama"
MAIN = "a" * 40
TAGGED = "b" * 40


def write_snapshot(cache, repo, commit, refs, config):
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    for ref in refs:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / ref).write_text(commit)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A cache with REPO at `main` (the tiny-llama preset) and at tag `v1` (the same, 3 layers); no Hub."""
    cache = tmp_path / "hub"
    config = json.loads((PRESETS / "tiny-llama.json").read_text())
    write_snapshot(cache, REPO, MAIN, ["main"], config)
    write_snapshot(cache, REPO, TAGGED, ["v1"], {**config, "num_hidden_layers": 3})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # connection refused at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    scanned = huggingface_hub.scan_cache_dir(cache)
    assert [r.repo_id for r in scanned.repos] == [REPO] and not scanned.warnings
    assert {ref for r in scanned.repos for rev in r.revisions for ref in rev.refs} == {"main", "v1"}
    return cache


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "hub-unreachable"])
def test_hub_id_resolves_from_the_cache(hub_cache, monkeypatch, offline):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main = resolve_model(REPO, "dummy")
    assert main.name == REPO and main.hf_config.num_hidden_layers == 2 and main.weights_dir is None
    assert resolve_model(REPO, "dummy", revision="v1").hf_config.num_hidden_layers == 3
    assert resolve_model(REPO, "dummy", revision=TAGGED).hf_config.num_hidden_layers == 3
    auto = resolve_model(REPO, "auto")  # the folder without weights: the loader, not the resolver, says so
    assert auto.weights_dir == hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN


@pytest.mark.parametrize("offline, why", [(True, "HF_HUB_OFFLINE is set"),
                                          (False, "the Hugging Face Hub cannot be reached")])
def test_absent_model_or_revision_says_how_to_get_it(hub_cache, monkeypatch, offline, why):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for model, revision in (("acme/absent", None), (REPO, "v2")):
        with pytest.raises(ValueError, match="not \\(completely\\) in the Hugging Face cache") as info:
            resolve_model(model, "dummy", revision=revision)
        assert why in str(info.value) and str(hub_cache) in str(info.value)
        assert f"hf download {model}" in str(info.value)


def test_revision_is_only_for_hub_ids(tmp_path):
    with pytest.raises(ValueError, match="applies to Hugging Face Hub model ids"):
        resolve_model("tiny-llama", "dummy", revision="main")
    for missing in (str(tmp_path / "no-such-model"), "no-such-preset", "./acme/tiny-llama"):  # never asks the Hub
        with pytest.raises(ValueError, match="nor a Hugging Face Hub id"):
            resolve_model(missing, "dummy")
    with pytest.raises(ValueError, match="engine argument revision"):
        LLM("tiny-llama", load_format="dummy", revision="")


def test_engine_runs_a_hub_revision(hub_cache):
    with LLM(REPO, load_format="dummy", revision="v1", num_kv_blocks=8, max_model_len=64) as llm:
        assert llm.hf_config.num_hidden_layers == 3 and llm.info.model == REPO
        out = llm.generate([3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].token_ids) == 2
