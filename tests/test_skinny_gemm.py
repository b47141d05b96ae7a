"""The skinny GEMM (decode-sized projections) against F.linear on fresh random inputs: split-K with its in-kernel
fix-up, uneven K, bias, rows past one row tile; and through the linear layers that use it.

Without CUDA it runs in Triton's interpreter (fp32, small shapes); `-m gpu` adds bf16/fp16 at Qwen3-0.6B's
projection shapes, the default configurations and programmatic dependent launch."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.kernels.skinny_gemm import SkinnyConfig, choose_config, skinny_linear

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize(("m", "n", "k", "config", "bias"), [
    (3, 96, 256, SkinnyConfig(16, 32, 64, 1), False),  # one split: direct store
    (5, 80, 512, SkinnyConfig(16, 32, 64, 4), True),  # split-K fix-up; n not a multiple of the tile; bias
    (20, 64, 300, SkinnyConfig(16, 32, 64, 2), True),  # two row tiles; K not a multiple of the split
    (33, 64, 512, SkinnyConfig(64, 32, 128, 2), False),  # one row tile, mostly padding
])
def test_matches_f_linear(m, n, k, config, bias):
    x, weight = randn(m, k, seed=1), randn(n, k, seed=2)
    b = randn(n, seed=3) if bias else None
    out = skinny_linear(x, weight, b, config)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert relative_error(out, F.linear(x, weight, b)) < 1e-5


def test_repeated_calls_reuse_the_workspace():
    """The last split of each tile zeroes its arrival counter: a second call (other shapes) is as exact."""
    config = SkinnyConfig(16, 32, 64, 4)
    for seed, (m, n, k) in enumerate([(4, 64, 512), (7, 96, 256), (4, 64, 512)]):
        x, weight = randn(m, k, seed=seed), randn(n, k, seed=seed + 10)
        assert relative_error(skinny_linear(x, weight, None, config), F.linear(x, weight)) < 1e-5


def test_split_k_fills_the_sms_without_splitting_k_too_thin():
    assert choose_config(16, 1024, 2048, 132).split_k == 4  # 32 tiles x 4 = 128 programs <= 132 SMs
    assert choose_config(16, 4096, 1024, 132).split_k == 1  # 128 tiles fill the SMs already
    assert choose_config(16, 1024, 256, 132).split_k == 1  # K too short to split (each split >= 2 x 128)
    assert choose_config(3, 64, 4096, 132).block_m == 16
    assert choose_config(200, 64, 4096, 132).block_m == 64


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama"])  # q/k/v bias (Qwen2) or none
def test_linear_layers_route_decode_batches_through_the_kernel(preset, monkeypatch):
    """The layers call the kernel for batches up to MAX_ROWS (half precision; fp32 on the GPU stays with
    cuBLAS: the kernel's tl.dot would round it to TF32), with the right weight slices and bias handling."""
    import json

    from conftest import PRESETS
    from transformers import AutoConfig

    import nanovllm.kernels.skinny_gemm as skinny_module
    from nanovllm.models.llama import LlamaAttention, LlamaMLP, llama_spec

    calls, original = [], skinny_module.skinny_linear

    def counting(x, weight, bias=None, config=None):
        calls.append(x.shape[0])
        return original(x, weight, bias, config)

    monkeypatch.setattr(skinny_module, "skinny_linear", counting)
    config = AutoConfig.for_model(**json.loads((PRESETS / f"{preset}.json").read_text()))
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    spec = llama_spec(config)
    with torch.device(DEVICE):
        attention, mlp = LlamaAttention(config, spec, 0, fused=True), LlamaMLP(config, spec, fused=True)
    attention, mlp = attention.to(dtype), mlp.to(dtype)
    for seed, param in enumerate([*attention.parameters(), *mlp.parameters()]):
        param.data = randn(*param.shape, dtype=dtype, seed=seed) * 0.1
    hidden = randn(6, config.hidden_size, dtype=dtype, seed=99)
    layers = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    for layer in layers:
        x = hidden if layer.weight.shape[1] == config.hidden_size else randn(6, layer.weight.shape[1], dtype=dtype)
        expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        assert relative_error(layer(x), expected) < 1e-2
    assert calls == [6] * len(layers)
    big = randn(skinny_module.MAX_ROWS + 1, config.hidden_size, dtype=dtype)
    if DEVICE.type == "cuda":  # the interpreter has no half-precision matmul outside the kernel
        attention.qkv_proj(big)
        assert calls == [6] * len(layers)  # past MAX_ROWS: cuBLAS


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 50, 64])
def test_qwen3_0_6b_projections_with_default_configs(dtype, m):
    """Qwen3-0.6B's four projections at decode batch sizes, default configuration, PDL as the device allows;
    back to back (each launch may overlap the one before it)."""
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
    inputs = [(randn(m, k, dtype=dtype, seed=i), randn(n, k, dtype=dtype, seed=10 + i) * 0.05)
              for i, (n, k) in enumerate(shapes)]
    outputs = [skinny_linear(x, w) for x, w in inputs]
    for (x, w), out in zip(inputs, outputs):
        assert relative_error(out, F.linear(x.float(), w.float())) < 1e-2


def test_only_small_weights_take_the_kernel():
    """Above MAX_WEIGHT_BYTES a projection's decode batches stay with cuBLAS (it streams a large weight faster);
    at or below it they take the kernel. The layers are built on the meta device: only their shapes matter."""
    from nanovllm.kernels.skinny_gemm import MAX_WEIGHT_BYTES
    from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear

    with torch.device("meta"):
        small = ColumnParallelLinear(1024, 6144, fused=True)  # Qwen3-0.6B's gate|up: 12 MiB in bf16
        large = RowParallelLinear(4096, 4096, fused=True)  # Qwen3-8B's o_proj: 32 MiB
        plain = ColumnParallelLinear(1024, 1024)
    assert 6144 * 1024 * 2 <= MAX_WEIGHT_BYTES < 4096 * 4096 * 2
    assert small.skinny is not None and large.skinny is None and plain.skinny is None
    assert small.fused and large.fused and not plain.fused  # FP8 weights keep their kernel choice either way
