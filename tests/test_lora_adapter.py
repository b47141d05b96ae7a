"""Reading PEFT LoRA adapters (core/lora/adapter.py): the matrices and scales against PEFT's own modules
(lora_alpha / r, rsLoRA, rank_pattern and alpha_pattern), a Hub id through huggingface_hub's cache, and every
refusal: each adapter below is one PEFT really saves (or a saved one with one field or tensor changed)."""
import json
import math

import huggingface_hub
import pytest
import torch
from conftest import PRESETS
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from nanovllm.lora.adapter import LoRARequest, load_adapter

pytest.importorskip("peft")

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_hf_model(preset: str = "tiny-qwen3", **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**json.loads((PRESETS / f"{preset}.json").read_text()), **overrides})
    return AutoModelForCausalLM.from_config(config)


def save_peft_adapter(directory, preset: str = "tiny-qwen3", seed: int = 0, **lora_config):
    """A PEFT LoRA of random (non-zero) A and B on a tiny random model, saved to `directory`; returns the
    PeftModel."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(tiny_hf_model(preset), LoraConfig(**{"init_lora_weights": False, **lora_config}))
    model.save_pretrained(directory)
    return model


def peft_modules(model) -> dict:
    """PEFT's LoRA layers by their HF module name (as adapters name them)."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {name.removeprefix(prefix): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@pytest.mark.parametrize("lora_config", [
    dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
    dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    dict(r=8, lora_alpha=32, target_modules=ALL_PROJECTIONS, rank_pattern={"down_proj": 4, "layers.1.self_attn.q_proj": 2},
         alpha_pattern={"o_proj": 3}),
], ids=["alpha-over-r", "rslora", "rank-and-alpha-patterns"])
def test_matrices_and_scales_match_peft(tmp_path, lora_config):
    model = save_peft_adapter(tmp_path, **lora_config)
    adapter = load_adapter(tmp_path, max_lora_rank=16, name="a")
    expected = peft_modules(model)
    assert set(adapter.modules) == set(expected)
    for name, module in adapter.modules.items():
        layer = expected[name]
        assert torch.equal(module.lora_a, layer.lora_A["default"].weight)
        assert torch.equal(module.lora_b, layer.lora_B["default"].weight)
        assert module.scale == pytest.approx(layer.scaling["default"], rel=1e-12)
    if lora_config.get("use_rslora"):
        assert adapter.modules["model.layers.0.self_attn.q_proj"].scale == pytest.approx(8 / math.sqrt(16))
    if "rank_pattern" in lora_config:
        assert adapter.modules["model.layers.0.mlp.down_proj"].rank == 4
        assert adapter.modules["model.layers.1.self_attn.q_proj"].rank == 2
        assert adapter.modules["model.layers.0.self_attn.q_proj"].rank == 8
        assert adapter.max_rank == 8


def _edit_config(directory, **fields):
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _edit_tensors(directory, edit):
    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.fixture
def plain(tmp_path):
    """A plain LoRA on q and v, saved by PEFT."""
    directory = tmp_path / "plain"
    save_peft_adapter(directory, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return directory


def _rename_q_to(tensors, module):
    for key in [k for k in tensors if "layers.0.self_attn.q_proj" in k]:
        tensors[key.replace("self_attn.q_proj", module)] = tensors.pop(key)


@pytest.mark.parametrize("peft_config, match", [
    (dict(r=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
    (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save replaces whole modules"),
    (dict(r=4, target_modules=["q_proj"], bias="lora_only"), "bias='lora_only' trains the base model's biases"),
    (dict(r=4, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
    (dict(r=4, target_modules=["q_proj", "lm_head"]), "the LM head and the embeddings take no adapters"),
    (dict(r=4, target_modules=["embed_tokens"]), "the LM head and the embeddings take no adapters"),
    (dict(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 4]), "trainable_token_indices"),
], ids=["dora", "modules-to-save", "bias", "lora-bias", "lm-head", "embeddings", "trainable-tokens"])
def test_refuses_what_peft_saves_beyond_plain_lora(tmp_path, peft_config, match):
    save_peft_adapter(tmp_path, **peft_config)
    with pytest.raises(ValueError, match=match) as info:
        load_adapter(tmp_path, max_lora_rank=16)
    assert "merge_and_unload" in str(info.value)  # the way out


@pytest.mark.parametrize("edit, match", [
    (dict(target_modules=["q_proj", "dense"]), "adapts 'dense': nanovllm applies adapters to these projections"),
    (dict(target_modules=["experts"]), "MoE experts and routers take no adapters"),
    (dict(use_shiny_variant=True), r"sets use_shiny_variant=True, which nanovllm does not implement"),
    (dict(megatron_config={"tensor_model_parallel_size": 2}), "sets megatron_config="),
    (dict(peft_type="IA3"), "peft_type is 'IA3'; nanovllm serves LoRA adapters only"),
    (dict(init_lora_weights="pissa_niter_4"), "path_initial_model_for_weight_conversion"),
    (dict(init_lora_weights="olora"), "changes the base model's weights"),
    (dict(r=4), r"lora_A \(8, 128\) and lora_B \(128, 8\), not of the rank 4"),
    (dict(rank_pattern={"v_proj": 2}), "not of the rank 2"),
], ids=["unknown-module", "moe-experts", "unknown-field", "megatron", "not-lora", "pissa", "olora",
        "rank-mismatch", "rank-pattern-mismatch"])
def test_refuses_config_fields_by_name(plain, edit, match):
    _edit_config(plain, **edit)
    with pytest.raises(ValueError, match=match):
        load_adapter(plain, max_lora_rank=16)


@pytest.mark.parametrize("edit, match", [
    (lambda t: _rename_q_to(t, "mlp.experts.3.gate_proj"), "MoE experts and routers take no adapters"),
    (lambda t: _rename_q_to(t, "mlp.gate"), "MoE experts and routers take no adapters"),
    (lambda t: _rename_q_to(t, "self_attn.dense"), "adapts 'model.layers.0.self_attn.dense'"),
    (lambda t: t.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"),
     "has lora_A but not both lora_A and lora_B"),
    (lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(128)}),
     "DoRA"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8, 128)}), "no LoRA matrix of PEFT's"),
], ids=["experts", "router", "unknown-module", "half-pair", "dora-tensor", "foreign-layout"])
def test_refuses_tensors_by_name(plain, edit, match):
    _edit_tensors(plain, edit)
    with pytest.raises(ValueError, match=match):
        load_adapter(plain, max_lora_rank=16)


def test_rank_above_max_lora_rank_names_the_setting(plain):
    with pytest.raises(ValueError, match="has rank 8 .*above max_lora_rank=4: start the engine with max_lora_rank >= 8"):
        load_adapter(plain, max_lora_rank=4)
    assert load_adapter(plain, max_lora_rank=8).max_rank == 8


def test_missing_files_say_what_is_missing(plain, tmp_path):
    (plain / "adapter_model.safetensors").rename(plain / "adapter_model.bin")
    with pytest.raises(ValueError, match="no adapter_model.safetensors .*safe_serialization=True"):
        load_adapter(plain, max_lora_rank=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        load_adapter(tmp_path / "empty", max_lora_rank=16)
    with pytest.raises(ValueError, match="neither a folder nor a Hugging Face Hub id"):
        load_adapter(tmp_path / "absent" / "x", max_lora_rank=16)


def test_hub_id_resolves_from_the_cache(plain, tmp_path, monkeypatch):
    """An adapter repository in huggingface_hub's cache layout, the Hub unreachable."""
    repo, commit = "acme/tiny-lora", "c" * 40
    folder = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    (folder / "snapshots" / commit).mkdir(parents=True)
    for file in plain.iterdir():
        (folder / "snapshots" / commit / file.name).write_bytes(file.read_bytes())
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # connection refused at once
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    adapter = load_adapter(repo, max_lora_rank=16)
    assert adapter.directory == folder / "snapshots" / commit and adapter.name == repo
    assert set(adapter.modules) == set(load_adapter(plain, max_lora_rank=16).modules)
    with pytest.raises(ValueError, match="adapter 'acme/absent' at revision 'main' is not .*in the Hugging Face cache"):
        load_adapter("acme/absent", max_lora_rank=16)


def test_request_ids_are_positive():
    assert LoRARequest("sql", 1, "/adapters/sql").lora_int_id == 1
    with pytest.raises(ValueError, match="lora_int_id must be a positive int"):
        LoRARequest("sql", 0, "/adapters/sql")
