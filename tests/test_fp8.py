"""FP8 weights (layers/fp8.py) on the CPU reference path: quantization bounds, the FP8 linear against the fp32
linear, tensor-parallel scale sharding, a tiny model quantized at load against the unquantized one, FP8
checkpoints in each supported format against the same model dequantized, and the errors where FP8 cannot run.

Documented error (e4m3: 3 mantissa bits, round to nearest):
- one value: |t - q·s| <= max(|t|·2^-4, s·2^-10) (relative half-ulp of a normal, half the subnormal step);
- one linear, weight and activations both quantized, Gaussian data: relative (Frobenius) error < 0.05;
- a model's logits (the tiny random models of conftest, 2 to 4 layers): relative (Frobenius) error
  < 0.12·sqrt(layers) (independent per-layer errors add in quadrature); the teacher-forced greedy choice (the argmax at
  each prompt position) agrees wherever the unquantized top two logits differ by more than 0.5 · the logits'
  std, and on >= 70% of all positions (these random models' median top-2 gap is only 0.2 std). A random model amplifies rounding:
  rounding the 2-layer Qwen3's projection weights alone to e4m3's 4 significant bits, without any scale,
  already moves its logits by 0.12 relative (measured 0.14 with FP8 weights and activations; the 4-layer
  Phi-3: 0.20); its logits are near-ties over a 512-token vocabulary.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import model_prompt_logits
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.layers import fp8 as fp8_module
from nanovllm.layers import linear as linear_module
from nanovllm.layers.fp8 import FP8_DTYPE, Fp8Scheme, dequantize, quantize, reference_linear
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.loaders import fp8_weights, load_weights
from nanovllm.loaders.fp8_weights import prepare_fp8
from nanovllm.loaders.quantization import fp8_scheme
from nanovllm.loaders.resolve import ResolvedModel, resolve_model
from nanovllm.models.registry import model_class_for

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
               "down_proj")
PROMPT = list(range(100, 148))
GPU_PROMPTS = [list(range(100 + 7 * i, 124 + 7 * i)) for i in range(4)]
CHANNEL_LINEAR_BOUND = 0.05
LOGIT_BOUND_PER_SQRT_LAYER = 0.12
AGREEMENT = 0.7
CLEAR_MARGIN = 0.5  # x the logits' std


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("block", [(1, 96), (1, 32), (32, 32), (16, 48)])
def test_quantize_round_trip_within_half_ulp(block):
    t = randn(64, 96, seed=1) * torch.logspace(-3, 1, 96)  # columns over four decades: subnormals too
    q, scale = quantize(t, block)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == (64 // block[0], 96 // block[1])
    back = dequantize(q, scale)
    spread = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    bound = torch.maximum(t.abs() * 2 ** -4, spread * 2 ** -10) * (1 + 1e-6)
    assert ((back - t).abs() <= bound).all()
    # each block's largest magnitude lands on the format's largest value
    tiles = q.float().abs().reshape(64 // block[0], block[0], 96 // block[1], block[1]).amax(dim=(1, 3))
    assert (tiles == 448).all()


@pytest.mark.parametrize("block", [(1, 96), (16, 32)])
@pytest.mark.parametrize("chunk", [None, 100])  # 100: one row of tiles per search
def test_weight_scale_search_keeps_the_least_error_scale(block, chunk, monkeypatch):
    """Each tile's scale is the candidate max|tile|/448 * 2^(j/16) of least squared error (the first on ties),
    tried here one tile and one candidate at a time; it is never below the max's scale, so nothing clips."""
    if chunk is not None:
        monkeypatch.setattr(fp8_module, "SEARCH_CHUNK", chunk)
    t = randn(64, 96, seed=5)
    bn, bk = block
    _, absmax_scale = quantize(t, block)
    q, scale = quantize(t, block, 16)
    back = dequantize(q, scale)
    total, total_absmax = 0.0, 0.0
    for i in range(64 // bn):
        for j in range(96 // bk):
            tile = t[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            errors = []
            for c in range(16):
                s_c = absmax_scale[i, j] * 2 ** (c / 16)
                rounded = (tile / s_c).clamp(-448, 448).to(FP8_DTYPE).float() * s_c
                errors.append((rounded - tile).square().sum().item())
            best = min(range(16), key=lambda c: (errors[c], c))
            assert scale[i, j].item() == pytest.approx(absmax_scale[i, j].item() * 2 ** (best / 16), rel=1e-6)
            got = (back[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] - tile).square().sum().item()
            assert got == pytest.approx(errors[best], rel=1e-5)
            total, total_absmax = total + got, total_absmax + errors[0]
    assert (scale >= absmax_scale).all()
    assert total < 0.95 * total_absmax  # measured 0.74 (per row) and 0.88 (16 x 32 tiles) of the max's error


def test_zero_rows_quantize_to_zero():
    q, scale = quantize(torch.zeros(4, 32), (1, 32))
    assert (q.float() == 0).all() and (scale > 0).all()


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_fp8_linear_matches_fp32_linear(block):
    x, w, b = randn(7, 128, seed=2), randn(96, 128, seed=3, scale=0.05), randn(96, seed=4)
    q, scale = quantize(w, block or (1, 128))
    out = reference_linear(x, q, scale, block, b)
    assert out.shape == (7, 96) and out.dtype == x.dtype
    assert relative_error(out, F.linear(x, w, b)) < CHANNEL_LINEAR_BOUND


def _shard_layers(make, world, monkeypatch):
    """One layer per rank of a `world`-way tensor-parallel group (rank and size patched where linear.py and
    fp8_weights.py read them)."""
    layers = []
    for rank in range(world):
        monkeypatch.setattr(linear_module, "tp_size", lambda: world)
        monkeypatch.setattr(linear_module, "tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(fp8_weights, "tp_size", lambda: world)
        layers.append(make())
    return layers


def _load_rank(layer, rank, monkeypatch, tensors: dict):
    """Load checkpoint tensors (name -> (tensor, part)) into a rank's layer as the loader does."""
    from nanovllm.loaders.weights import load_whole

    monkeypatch.setattr(linear_module, "tp_rank", lambda: rank)
    for name, (tensor, part) in tensors.items():
        param = getattr(layer, name.split(":")[0])
        if part is None:
            load_whole(param, layer.weight_loader, tensor)
        else:
            layer.weight_loader(param, tensor, part)


@pytest.mark.parametrize("block", [None, (16, 32)])
@pytest.mark.parametrize("world", [1, 2])
def test_sharded_checkpoint_scales_match_the_whole_layer(block, world, monkeypatch):
    """Column (packed q|k|v, gate|up) and row-parallel FP8 layers loaded from whole checkpoint tensors: the ranks'
    outputs, concatenated (column) or summed (row), equal the whole layer's FP8 rule."""
    scheme = Fp8Scheme(block, True, "test")
    x = randn(5, 64, seed=5)

    def fp8_part(seed, rows, cols):
        return quantize(randn(rows, cols, seed=seed, scale=0.1), (block or (1, cols)))

    # q|k|v: 4 q heads and 2 kv heads of 16
    parts = {"q": fp8_part(10, 64, 64), "k": fp8_part(11, 32, 64), "v": fp8_part(12, 32, 64)}

    ranks = _shard_layers(lambda: _prepared(QKVParallelLinear(64, 16, 4, 2), scheme), world, monkeypatch)
    for rank, layer in enumerate(ranks):
        _load_rank(layer, rank, monkeypatch, {f"weight:{p}": (q, p) for p, (q, _) in parts.items()}
                   | {f"weight_scale:{p}": (s, p) for p, (_, s) in parts.items()})
    outs = [layer.matmul(x, None) for layer in ranks]
    # each rank holds [q_r | k_r | v_r]: compare per part
    for part in "qkv":
        q, s = parts[part]
        expected = reference_linear(x, q, s, block, None)
        width = expected.shape[1] // world
        offset = {"q": 0, "k": 64 // world, "v": 96 // world}[part]
        got = torch.cat([out[:, offset:offset + width] for out in outs], dim=1)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # gate|up, whole packed tensor as Phi-3 stores it
    gate, up = fp8_part(13, 64, 64), fp8_part(14, 64, 64)
    ranks = _shard_layers(lambda: _prepared(MergedColumnParallelLinear(64, [64, 64]), scheme), world, monkeypatch)
    for rank, layer in enumerate(ranks):
        _load_rank(layer, rank, monkeypatch, {"weight": (torch.cat([gate[0], up[0]]), None),
                                              "weight_scale": (torch.cat([gate[1], up[1]]), None)})
    outs = [layer.matmul(x, None) for layer in ranks]
    half = 64 // world
    for index, (q, s) in enumerate((gate, up)):
        got = torch.cat([out[:, index * half:(index + 1) * half] for out in outs], dim=1)
        torch.testing.assert_close(got, reference_linear(x, q, s, block, None), rtol=1e-5, atol=1e-5)

    # row-parallel down: each rank multiplies its slice of x; per-channel scales are whole on every rank
    down = fp8_part(15, 48, 64)
    ranks = _shard_layers(lambda: _prepared(RowParallelLinear(64, 48), scheme), world, monkeypatch)
    for rank, layer in enumerate(ranks):
        _load_rank(layer, rank, monkeypatch, {"weight": (down[0], None), "weight_scale": (down[1], None)})
    cols = 64 // world
    # activations are quantized per rank over its own columns (per token, or per group within them)
    total = sum(reference_linear(x[:, r * cols:(r + 1) * cols], layer.weight, layer.weight_scale, block, None)
                for r, layer in enumerate(ranks))
    expected_weight = dequantize(*down)
    assert relative_error(total, x @ expected_weight.T) < CHANNEL_LINEAR_BOUND
    for r, layer in enumerate(ranks):  # and each rank's weight is exactly its slice of the checkpoint's
        torch.testing.assert_close(dequantize(layer.weight, layer.weight_scale),
                                   expected_weight[:, r * cols:(r + 1) * cols])


class _Holder(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


def _prepared(layer, scheme):
    prepare_fp8(_Holder(layer), scheme)
    return layer


def _model(directory: Path | None, quantization=None, preset=None):
    resolved = resolve_model(str(directory) if directory else preset, load_format="auto" if directory else "dummy")
    model_class = model_class_for(resolved.hf_config)
    scheme = fp8_scheme(quantization, resolved, torch.device("cpu"), hasattr(model_class, "expert_projections"))
    model = model_class(resolved.hf_config).eval()
    load_weights(model, resolved.weights_dir, scheme)
    return model


def _compare_logits(got: torch.Tensor, expected: torch.Tensor, layers: int) -> None:
    assert relative_error(got, expected) < LOGIT_BOUND_PER_SQRT_LAYER * layers ** 0.5
    agree = got.argmax(-1) == expected.argmax(-1)
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > CLEAR_MARGIN * expected.std()
    assert agree[clear].all() and clear.any()
    assert agree.float().mean().item() >= AGREEMENT


def test_quantized_at_load_model_matches_unquantized(tiny_model_dirs):
    directory = tiny_model_dirs["qwen3"]
    model = _model(directory, "fp8")
    fp8_weights = [n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE]
    assert len(fp8_weights) == 2 * 4  # qkv, o, gate_up, down of 2 layers
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    _compare_logits(model_prompt_logits(model, PROMPT, 16), model_prompt_logits(_model(directory), PROMPT, 16),
                    len(model.model.layers))


def test_engine_runs_fp8_greedy_like_the_fp8_model(tiny_model_dirs):
    """The engine (paged cache, batching) generates with the FP8 model what step-by-step argmax of the same FP8
    model gives."""
    directory = tiny_model_dirs["qwen3"]
    model = _model(directory, "fp8")
    tokens = list(PROMPT[:12])
    for _ in range(6):
        tokens.append(int(model_prompt_logits(model, tokens, 64)[-1].argmax()))
    with LLM(str(directory), quantization="fp8", num_kv_blocks=16, max_model_len=64) as llm:
        out = llm.generate([PROMPT[:12]], SamplingParams(max_tokens=6, temperature=0))
    assert out[0].outputs[0].token_ids == tokens[12:]


def test_moe_experts_and_router_stay_unquantized():
    model = _model(None, "fp8", preset="tiny-qwen3-moe")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight"] == FP8_DTYPE
    assert all(d != FP8_DTYPE for n, d in dtypes.items() if ".experts." in n or n.endswith("mlp.gate.weight"))
    assert any(".experts." in n for n in dtypes)


def _write_fp8_checkpoint(source: Path, target: Path, fmt: str) -> Path:
    """`source` (an fp32 HF checkpoint) with its decoder projections in FP8 in format `fmt`; returns a directory
    of the same model with those weights dequantized (the reference)."""
    target.mkdir()
    reference = target.parent / f"{target.name}-dequantized"
    reference.mkdir()
    tensors = {}
    for file in source.glob("*.safetensors"):
        tensors |= load_file(file)
    quantized, dequantized = {}, {}
    block = [32, 32] if fmt == "fp8" else None
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            q, scale = quantize(tensor, tuple(block) if block else (1, tensor.shape[1]))
            quantized[name] = q
            quantized[name.replace(".weight", ".weight_scale_inv" if fmt == "fp8" else ".weight_scale")] = scale
            dequantized[name] = dequantize(q, scale)
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, str(target / "model.safetensors"))
    save_file(dequantized, str(reference / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps(config))
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": block}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True}}}}
    (target / "config.json").write_text(json.dumps(config))
    return reference


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_fp8_checkpoint_matches_dequantized_model(fmt, tiny_model_dirs, tmp_path):
    target = tmp_path / fmt
    reference = _write_fp8_checkpoint(tiny_model_dirs["qwen3"], target, fmt)
    _check_fp8_checkpoint(target, reference, fmt)


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_phi3_fp8_checkpoint_with_packed_tensors(fmt, arch_model_dirs, tmp_path):
    """Phi-3 stores q|k|v and gate|up stacked: their scales are cut into the same parts as the weights."""
    target = tmp_path / fmt
    reference = _write_fp8_checkpoint(arch_model_dirs["phi3-longrope"], target, fmt)
    _check_fp8_checkpoint(target, reference, fmt)


def test_phi3_quantized_at_load(arch_model_dirs):
    directory = arch_model_dirs["phi3-longrope"]
    model = _model(directory, "fp8")
    _compare_logits(model_prompt_logits(model, PROMPT, 16), model_prompt_logits(_model(directory), PROMPT, 16),
                    len(model.model.layers))


def _check_fp8_checkpoint(target: Path, reference: Path, fmt: str) -> None:
    model = _model(target)
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == FP8_DTYPE and layer.fp8.in_checkpoint
    assert layer.fp8.block == ((32, 32) if fmt == "fp8" else None)
    # only the activations' quantization differs from the dequantized model
    _compare_logits(model_prompt_logits(model, PROMPT, 16), model_prompt_logits(_model(reference), PROMPT, 16),
                    len(model.model.layers))


def _resolved(tmp_path, quantization_config=None, gguf=False, weights=True):
    from transformers import AutoConfig

    extra = {"quantization_config": quantization_config} if quantization_config else {}
    config = AutoConfig.for_model("qwen3", hidden_size=64, num_attention_heads=2, num_key_value_heads=1, **extra)
    return ResolvedModel("m", config, tmp_path if weights else None, None, gguf=gguf)


_CHANNEL_GROUP = {"targets": ["Linear"],
                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {**_CHANNEL_GROUP, "weights": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}, "strategy': 'tensor'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {**_CHANNEL_GROUP, "input_activations": None}}},
     "input_activations None"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": _CHANNEL_GROUP}, "ignore": ["re:.*down_proj"]},
     "left unquantized"),
])
def test_unsupported_checkpoint_schemes_list_the_supported(qc, message, tmp_path):
    with pytest.raises(ValueError, match="supported quantization_config formats") as info:
        fp8_scheme(None, _resolved(tmp_path, qc), torch.device("cpu"), has_experts=False)
    assert message in str(info.value)
    assert "compressed-tensors" in str(info.value) and "weight_block_size" in str(info.value)


def test_where_fp8_cannot_run(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    # a GGUF file loads dequantized in the model dtype, so it is quantized at load like a float checkpoint
    assert fp8_scheme("fp8", _resolved(tmp_path, gguf=True), cpu, has_experts=False).name.endswith("per channel)")
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="mixture-of-experts"):
        fp8_scheme(None, _resolved(tmp_path, block), cpu, has_experts=True)
    # dummy weights of an FP8 MoE config are fine: quantized after drawing
    assert not fp8_scheme(None, _resolved(tmp_path, block, weights=False), cpu, has_experts=True).in_checkpoint
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.9.*this GPU is 8.0"):
        fp8_scheme("fp8", _resolved(tmp_path), torch.device("cuda"), has_experts=False)
    with pytest.raises(ValueError, match="quantization='int8'.*fp8"):
        LLM("tiny-qwen3", load_format="dummy", quantization="int8")
    assert fp8_scheme(None, _resolved(tmp_path), cpu, has_experts=False) is None


def test_checkpoint_dtype_must_match_its_declared_layout(tiny_model_dirs, tmp_path):
    """A projection stored in fp32 in a checkpoint that declares FP8 is an error, not a silent cast."""
    target = tmp_path / "ckpt"
    _write_fp8_checkpoint(tiny_model_dirs["qwen3"], target, "compressed-tensors")
    tensors = load_file(target / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.weight.*torch.float32.*float8"):
        _model(target)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["quantized-at-load", "fp8"])
def test_gpu_fp8_engine_matches_the_cpu_reference(fmt, tiny_model_dirs, tmp_path):
    """In float32 the GPU's FP8 kernels (per channel; block-scaled from a checkpoint) and the CPU reference apply
    the same rule: their prompt logprobs differ by a small fraction of what the quantization itself moves them
    (summation order can still flip an activation's FP8 rounding, so greedy runs may part at near-ties). In bf16
    (fused ops, CUDA graphs) the FP8 engine runs and its first greedy token matches the unquantized bf16
    engine's on most prompts."""
    if fmt == "fp8":
        directory, quantization = tmp_path / "ckpt", None
        _write_fp8_checkpoint(tiny_model_dirs["qwen3"], directory, fmt)
    else:
        directory, quantization = tiny_model_dirs["qwen3"], "fp8"

    def prompt_logprobs(path, quantization, **engine) -> torch.Tensor:
        with LLM(str(path), quantization=quantization, num_kv_blocks=32, max_model_len=64, **engine) as llm:
            outputs = llm.generate(GPU_PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0))
        return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob
                             for out, prompt in zip(outputs, GPU_PROMPTS) for i in range(1, len(prompt))])

    reference = prompt_logprobs(directory, quantization, device="cpu")
    gpu = prompt_logprobs(directory, quantization, device="cuda", dtype="float32", attention_backend="torch")
    unquantized = prompt_logprobs(tiny_model_dirs["qwen3"], None, device="cpu")
    quantization_effect = (reference - unquantized).abs().max().item()
    gpu_error = (gpu - reference).abs().max().item()
    print(f"fp8 GPU vs CPU reference: {gpu_error:.5f}; quantization effect {quantization_effect:.5f}")
    assert quantization_effect > 0 and gpu_error <= 0.25 * quantization_effect

    greedy = SamplingParams(max_tokens=8, temperature=0)
    with LLM(str(directory), quantization=quantization, num_kv_blocks=32, max_model_len=64, dtype="bfloat16") as llm:
        fp8_bf16 = [o.outputs[0].token_ids for o in llm.generate(GPU_PROMPTS, greedy)]
    with LLM(str(tiny_model_dirs["qwen3"]), num_kv_blocks=32, max_model_len=64, dtype="bfloat16") as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(GPU_PROMPTS, greedy)]
    assert sum(a[0] == b[0] for a, b in zip(fp8_bf16, plain)) >= 3


def test_cli_quantization_flag_reaches_the_engine():
    from typer.testing import CliRunner

    from nanovllm_cli.main import app

    args = ["bench", "--model", "tiny-qwen3", "--load-format", "dummy", "--max-model-len", "256", "--num-seqs", "2",
            "--input-len-range", "5", "9", "--output-len-range", "2", "3", "--json"]
    result = CliRunner().invoke(app, [*args, "--quantization", "fp8"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["engine"]["quantization"] == "fp8 (quantized at load, per channel)"
    bad = CliRunner().invoke(app, [*args, "--quantization", "int4"])
    assert bad.exit_code == 2 and "quantization='int4'" in bad.output


def test_tp2_fp8_block_checkpoint_equals_tp1(tiny_model_dirs, tmp_path):
    """Real tensor parallelism (two processes): each rank loads its shard of the FP8 weights and of their block
    scales (rows for q|k|v and gate|up, columns for o and down). Block scales keep every rank's activation groups
    those of the whole layer, so TP=2 computes what TP=1 does, up to the order of the all-reduce's sum. On the CPU
    also where a GPU is (`gpu_check.sh fp8` runs this file on one)."""
    directory = tmp_path / "ckpt"
    _write_fp8_checkpoint(tiny_model_dirs["qwen3"], directory, "fp8")
    engine = {"max_model_len": 64, "num_kv_blocks": 32, "device": "cpu"}
    greedy = SamplingParams(max_tokens=8, temperature=0)
    with LLM(str(directory), **engine) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(GPU_PROMPTS, greedy)]
    with LLM(str(directory), tensor_parallel_size=2, **engine) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(GPU_PROMPTS, greedy)] == reference


def test_checkpoints_may_leave_the_head_and_routers_unquantized(tmp_path):
    qc = {"quant_method": "compressed-tensors", "config_groups": {"g": _CHANNEL_GROUP},
          "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]}
    scheme = fp8_scheme(None, _resolved(tmp_path, qc), torch.device("cpu"), has_experts=False)
    assert scheme.block is None and scheme.in_checkpoint
    hf = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "modules_to_not_convert": ["lm_head"]}
    assert fp8_scheme(None, _resolved(tmp_path, hf), torch.device("cpu"), has_experts=False).block == (128, 128)
