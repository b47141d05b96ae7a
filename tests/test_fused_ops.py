"""The fused small-op kernels against the torch layers they replace (the reference), on fresh random inputs.

Without CUDA they run in Triton's interpreter on small shapes (fp32, fp16); `-m gpu` adds bf16 and real shapes."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.kernels import fused_ops
from nanovllm.kernels.fp8_formats import FP8_DTYPE, Fp8Activation
from nanovllm.kernels.fp8_gemm import quantize_groups
from nanovllm.kernels.fused_ops import qk_norm_rope, rms_norm, silu_and_mul
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative L2 error: both paths round to the activation dtype at the same points, only float32 sums differ.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert out.isfinite().all()
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error <= TOLERANCE[out.dtype], f"relative error {error:.2e}"


def randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: not a power of two, the tail is masked
def test_rms_norm_with_and_without_residual(dtype, hidden):
    norm = RMSNorm(hidden, 1e-6).to(DEVICE)
    norm.weight.data = randn(hidden, dtype=torch.float32, seed=1).to(dtype) * 0.3 + 1
    x, residual = randn(7, hidden, dtype=dtype, seed=2), randn(7, hidden, dtype=dtype, seed=3)
    close(rms_norm(x, norm.weight, norm.eps), norm(x))
    out, new_residual = rms_norm(x, norm.weight, norm.eps, residual)
    ref_out, ref_residual = norm(x, residual)
    close(out, ref_out)
    assert torch.equal(new_residual, ref_residual)  # one rounding of one add: bit for bit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "with_norm"), [(4, 2, True), (6, 2, False), (3, 3, True)])
def test_qk_norm_rope_in_place_on_views_of_the_qkv_projection(dtype, num_heads, num_kv_heads, with_norm):
    head_dim, tokens = 32, 5
    rotary = RotaryEmbedding(head_dim, 64, {"rope_theta": 10000.0, "rope_type": "default"}).to(DEVICE)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(DEVICE), RMSNorm(head_dim, 1e-6).to(DEVICE)
    q_norm.weight.data = randn(head_dim, dtype=torch.float32, seed=4).to(dtype) * 0.3 + 1
    k_norm.weight.data = randn(head_dim, dtype=torch.float32, seed=5).to(dtype) * 0.3 + 1
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=6)
    positions = torch.tensor([0, 3, 17, 63, 5], device=DEVICE)

    def split(t):
        q, k, v = t.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        return (q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim),
                v.view(tokens, num_kv_heads, head_dim))

    q, k, _ = split(qkv.clone())
    if with_norm:
        q, k = q_norm(q), k_norm(k)
    ref_q, ref_k = rotary(positions, q, k)

    fused = qkv.clone()
    q, k, v = split(fused)
    qk_norm_rope(q, k, positions, rotary.cos_sin, q_norm.weight if with_norm else None,
                 k_norm.weight if with_norm else None, 1e-6)
    close(q, ref_q)
    close(k, ref_k)
    assert torch.equal(v, split(qkv)[2])  # v, in the same buffer, untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 1500])  # 1500: two column blocks, the second one partial
def test_silu_and_mul(dtype, width):
    x = randn(3, 2 * width, dtype=dtype, seed=7)
    close(silu_and_mul(x), SiluAndMul()(x))


def same_as_separate_quantization(fused, unquantized: torch.Tensor) -> None:
    """A quantized output is what quantize_groups makes of the unquantized one, byte for byte."""
    assert isinstance(fused, Fp8Activation) and fused.dtype == unquantized.dtype
    values, scales = quantize_groups(unquantized, unquantized.shape[1])
    assert fused.values.dtype == FP8_DTYPE and fused.scales.shape == (unquantized.shape[0], 1)
    assert torch.equal(fused.scales, scales)
    assert torch.equal(fused.values.view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_quantized_output(dtype, hidden):
    weight = randn(hidden, dtype=torch.float32, seed=1).to(dtype) * 0.3 + 1
    x, residual = randn(7, hidden, dtype=dtype, seed=2) * 3, randn(7, hidden, dtype=dtype, seed=3)
    x[2] = 0  # a zero row (no residual): scale floored, values zero
    same_as_separate_quantization(rms_norm(x, weight, 1e-6, quantize=True), rms_norm(x, weight, 1e-6))
    fused, fused_residual = rms_norm(x, weight, 1e-6, residual, quantize=True)
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    same_as_separate_quantization(fused, out)
    assert torch.equal(fused_residual, new_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("width", "row_max"), [
    (48, None), (2500, None),  # one pass: the row in one block (2500: padded to 4096)
    (2500, 1024),  # a row wider than row_max: the plain kernel, then quantize_groups
])
def test_silu_and_mul_quantized_output(dtype, width, row_max, monkeypatch):
    if row_max is not None:
        monkeypatch.setattr(fused_ops, "QUANTIZE_ROW_MAX", row_max)
    x = randn(3, 2 * width, dtype=dtype, seed=7) * 4
    same_as_separate_quantization(silu_and_mul(x, quantize=True), silu_and_mul(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_shapes_qwen3_0_6b(dtype):
    """Qwen3-0.6B: hidden 1024, 16/8 heads of 128, intermediate 3072; a prefill-sized token count."""
    tokens, hidden = 4096, 1024
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    x, residual = randn(tokens, hidden, dtype=dtype, seed=8), randn(tokens, hidden, dtype=dtype, seed=9)
    out, _ = rms_norm(x, norm.weight, norm.eps, residual)
    close(out, norm(x, residual)[0])
    gate_up = randn(tokens, 2 * 3072, dtype=dtype, seed=10)
    close(silu_and_mul(gate_up), SiluAndMul()(gate_up))
    rotary = RotaryEmbedding(128, 40960, {"rope_theta": 1000000.0, "rope_type": "default"}).to(DEVICE)
    qkv = randn(tokens, 32 * 128, dtype=dtype, seed=11)
    positions = torch.randint(0, 40960, (tokens,), device=DEVICE)
    q, k = qkv[:, :2048].view(tokens, 16, 128), qkv[:, 2048:3072].view(tokens, 8, 128)
    weight = torch.ones(128, dtype=dtype, device=DEVICE)
    q_norm = RMSNorm(128, 1e-6).to(DEVICE, dtype)
    ref_q, ref_k = rotary(positions, q_norm(q), q_norm(k))
    qk_norm_rope(q, k, positions, rotary.cos_sin, weight, weight, 1e-6)
    close(q, ref_q)
    close(k, ref_k)


def tiny_model_logits(preset: str, fused_variants, prepare=None) -> list[torch.Tensor]:
    """The logits of one 40-token prompt through the preset's model built once per entry of `fused_variants`
    (its fused_ops), all with the same dummy weights (norm weights made distinct); `prepare(model)` runs on each
    model after loading."""
    import json

    from conftest import PRESETS
    from transformers import AutoConfig

    from nanovllm.attention.metadata import AttentionMetadata
    from nanovllm.attention.torch_backend import TorchAttentionBackend
    from nanovllm.loaders import load_dummy_weights
    from nanovllm.models.geometry import head_dim_of
    from nanovllm.models.llama import LlamaForCausalLM

    config = AutoConfig.for_model(**json.loads((PRESETS / f"{preset}.json").read_text()))
    num_tokens, block_size = 40, 16
    num_blocks = -(-num_tokens // block_size)
    ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=DEVICE),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=DEVICE)[None], max_query_len=num_tokens,
        max_seq_len=num_tokens)
    logits, weights = [], None
    for fused in fused_variants:
        with torch.device(DEVICE):
            model = LlamaForCausalLM(config, fused_ops=fused)
        if weights is None:
            load_dummy_weights(model, seed=1)
            gen = torch.Generator().manual_seed(2)
            for name, param in model.named_parameters():  # dummy norms are all 1: make each one its own
                if name.endswith("norm.weight"):
                    param.data = (1 + 0.3 * torch.randn(param.shape, generator=gen)).to(param)
            weights = model.state_dict()
        model.load_state_dict(weights)
        if prepare is not None:
            prepare(model)
        for layer in model.attention_layers():
            layer.k_cache, layer.v_cache = torch.zeros(2, num_blocks, block_size, config.num_key_value_heads,
                                                       head_dim_of(config), device=DEVICE).unbind(0)
            layer.backend = TorchAttentionBackend()
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids.to(DEVICE), torch.arange(num_tokens, device=DEVICE),
                                                     meta)))
    return logits


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama", "tiny-qwen2"])  # q/k norm or not, biases
def test_whole_model_with_fused_ops_matches_the_torch_layers(preset):
    """The wiring: every fused call site gets the right weights, eps and layout, for each model family."""
    unfused, fused = tiny_model_logits(preset, (False, True))
    close(fused, unfused)


# The modules that quantize for their FP8 linear in a decoder layer: a dense one, and one whose MLP routes
ONE_INPUT = ("input_layernorm",)
DENSE = ("input_layernorm", "post_attention_layernorm", "mlp.act")


def test_fp8_linears_take_the_quantized_outputs_of_the_fused_kernels(monkeypatch):
    """Under quantization="fp8" the input norm feeds q|k|v, the post-attention norm gate|up and SiLU-and-mul
    down already quantized; the logits are those of the same FP8 model quantizing each input separately, bit
    for bit. (On the CPU the separate path is made to run the same interpreted kernels: the torch reference
    rounds to FP8 correctly, the interpreter not always; test_fp8_kernel.py covers that.)"""
    from nanovllm.layers import fp8 as fp8_module
    from nanovllm.loaders.fp8_weights import finish_fp8

    if DEVICE.type == "cpu":
        def separately_quantized(x, weight, scale, block, bias):
            return fp8_module.fp8_linear(Fp8Activation(*quantize_groups(x, x.shape[1]), x.dtype), weight, scale,
                                         block, bias)

        monkeypatch.setattr(fp8_module, "reference_linear", separately_quantized)
    scheme = fp8_module.Fp8Scheme(block=None, in_checkpoint=False, name="fp8")
    marked = {}

    def quantize_weights(model, fuse=True):
        finish_fp8(model, scheme)
        marked[fuse] = {name for name, m in model.named_modules() if getattr(m, "quantize_output", False)}
        if not fuse:
            for m in model.modules():
                if getattr(m, "quantize_output", False):
                    m.quantize_output = False

    fused, separate = (tiny_model_logits("tiny-qwen3", (True,), prepare=lambda m, f=fuse: quantize_weights(m, f))[0]
                       for fuse in (True, False))
    assert marked[True] == {f"model.layers.{i}.{name}" for i in range(2) for name in DENSE}
    assert torch.equal(fused, separate)


@pytest.mark.parametrize(("family", "quantizing"), [
    # layer 1 is dense (mlp_only_layers); the others route on the post-attention norm's output
    ("tiny-qwen3-moe", {0: ONE_INPUT, 1: DENSE, 2: ONE_INPUT}),
    # sandwich norms: the MLP reads the pre-feedforward norm; GELU has no kernel, so down quantizes for itself
    ("gemma2", {i: ("input_layernorm", "pre_feedforward_layernorm") for i in range(4)}),
    ("phi3-longrope", {i: DENSE for i in range(4)}),
])
def test_which_kernels_quantize_for_their_fp8_linear(family, quantizing):
    """`fuse_activation_quantization` flags a module only where its output feeds one per-channel FP8 linear and
    nothing else, in each family's decoder."""
    import json

    from conftest import ARCH_CONFIGS, PRESETS
    from transformers import AutoConfig

    from nanovllm.layers.fp8 import Fp8Scheme
    from nanovllm.loaders.fp8_weights import fp8_layers, fuse_activation_quantization
    from nanovllm.models.registry import model_class_for

    fields = ARCH_CONFIGS[family] if family in ARCH_CONFIGS else json.loads((PRESETS / f"{family}.json").read_text())
    config = AutoConfig.for_model(**fields)
    model = model_class_for(config)(config, fused_ops=True)
    for _, layer in fp8_layers(model):
        layer.fp8 = Fp8Scheme(block=None, in_checkpoint=False, name="fp8")
    fuse_activation_quantization(model)
    flagged = {name for name, m in model.named_modules() if getattr(m, "quantize_output", False)}
    assert flagged == {f"model.layers.{i}.{name}" for i, names in quantizing.items() for name in names}
