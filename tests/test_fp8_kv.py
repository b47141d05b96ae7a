"""FP8 KV cache (kv_cache_dtype): the quantization rule's bounds, the engine against the unquantized engine, the KV
budget, and the errors where FP8 cannot run. The kernels' FP8 paths are in test_kernels.py."""
import json
import random

import pytest
import torch
from typer.testing import CliRunner

from nanovllm import LLM, SamplingParams
from nanovllm.attention import select_backend
from nanovllm.attention.kv_quant import check_fp8_kv_supported, dequantize, quantize
from nanovllm_cli.main import app

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (mantissa bits, smallest normal, largest finite): a normal value rounds to within half a unit of its last place,
# 2^-(mantissa + 1) relative; below the smallest normal the step is fixed, smallest normal x 2^-mantissa.
FORMATS = {E4M3: (3, 2.0 ** -6, 448.0), E5M2: (2, 2.0 ** -14, 57344.0)}
# The engine's prompt logprobs with an FP8 cache against the same engine with an fp32 cache (tiny dummy presets;
# measured at most 0.035 for e4m3 and 0.074 for e5m2): docs/FP8.md.
ENGINE_LOGPROB_ERROR = {"fp8": 0.1, "fp8_e5m2": 0.2}


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 8.0])
def test_round_trip_bounds(dtype, scale):
    mantissa, smallest_normal, largest = FORMATS[dtype]
    gen = torch.Generator().manual_seed(0)
    # every binade of the format, both signs, plus values past its range
    x = torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-20, 20, (20000,), generator=gen).float())
    x = x * scale
    back = dequantize(quantize(x, scale, dtype), scale)
    assert back.dtype == torch.float32 and back.isfinite().all()
    y = x / scale  # in the format's units
    inside = y.abs() <= largest
    normal = inside & (y.abs() >= smallest_normal)
    error = (back - x).abs() / scale
    assert (error[normal] <= y[normal].abs() * 2.0 ** -(mantissa + 1) * (1 + 1e-6)).all()
    subnormal = y.abs() < smallest_normal
    assert (error[subnormal] <= smallest_normal * 2.0 ** -(mantissa + 1) * (1 + 1e-6)).all()
    assert (back[~inside] == torch.sign(x[~inside]) * largest * scale).all()  # saturates, never inf or NaN
    assert normal.sum() > 5000 and subnormal.sum() > 500 and (~inside).sum() > 500  # each case is exercised


def test_round_trip_is_exact_on_the_grid():
    for dtype in (E4M3, E5M2):
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        grid = grid[grid.isfinite()]
        assert torch.equal(dequantize(quantize(grid * 0.5, 0.5, dtype), 0.5), grid * 0.5)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(512) for _ in range(n)] for n in (40, 97, 150, 23)]


def _token_logprobs(entries, tokens) -> list[float]:
    return [entry[token].logprob for entry, token in zip(entries, tokens)]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_engine_logprobs_close_to_the_fp32_cache(preset):
    """The FP8 engines' logprobs of their prompts (chunked prefill: later chunks read earlier ones from the cache)
    and of their greedy tokens (decode) against the fp32-cache engine scoring the same sequences."""
    prompts = _prompts()
    engine_args = dict(load_format="dummy", max_model_len=256, max_num_batched_tokens=64,
                       cpu_kv_cache_bytes=1 << 24)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    runs = {}
    for kv in ENGINE_LOGPROB_ERROR:
        with LLM(preset, kv_cache_dtype=kv, **engine_args) as llm:
            runs[kv] = llm.generate(prompts, params)
    with LLM(preset, **engine_args) as llm:
        for kv, outputs in runs.items():
            sequences = [prompt + out.token_ids for prompt, out in zip(prompts, outputs)]
            references = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=0))
            diff = 0.0
            for sequence, out, ref in zip(sequences, outputs, references):
                ours = (_token_logprobs(out.prompt_logprobs[1:], sequence[1:])
                        + _token_logprobs(out.logprobs, out.token_ids))
                theirs = _token_logprobs(ref.prompt_logprobs[1:], sequence[1:])
                assert len(ours) == len(theirs) == len(sequence) - 1
                diff = max(diff, *(abs(a - b) for a, b in zip(ours, theirs)))
            bound = ENGINE_LOGPROB_ERROR[kv]
            assert 0 < diff <= bound, f"{kv}: logprobs differ by up to {diff:.3f} (bound {bound})"


def test_kv_budget_doubles_and_info_reports_fp8():
    sizes = {}
    for kv in ("auto", "fp8"):
        with LLM("tiny-qwen3", load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv,
                 cpu_kv_cache_bytes=1 << 22) as llm:
            sizes[kv] = llm.info
    auto, fp8 = sizes["auto"], sizes["fp8"]
    assert (auto.kv_cache_dtype, fp8.kv_cache_dtype, fp8.dtype) == ("bfloat16", "float8_e4m3fn", "bfloat16")
    # tiny-qwen3: 2 layers x 2 KV heads x 32 dims, K and V, 16-token blocks
    assert auto.kv_block_bytes == 2 * 2 * 16 * 2 * 32 * 2 == 2 * fp8.kv_block_bytes
    assert fp8.num_kv_blocks == 2 * auto.num_kv_blocks == (1 << 22) // fp8.kv_block_bytes
    assert auto.costs.kv_bytes_per_token == 2 * fp8.costs.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2
    assert auto.costs.weights == fp8.costs.weights  # the weights are not quantized


def test_bad_kv_cache_dtype_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp4'.*'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"):
        LLM("tiny-qwen3", load_format="dummy", kv_cache_dtype="fp4")


def test_backend_that_cannot_read_fp8_is_an_error(monkeypatch):
    from nanovllm.attention.flash_attn_backend import FlashAttnBackend

    monkeypatch.setattr(FlashAttnBackend, "__init__", lambda self: None)  # its own imports flash_attn
    assert select_backend("flash-attn", torch.device("cpu")).name == "flash-attn"
    with pytest.raises(ValueError, match=r"attention_backend='flash-attn' cannot read an FP8 KV cache "
                                         r"\(kv_cache_dtype='fp8'\): use attention_backend='triton'"):
        select_backend("flash-attn", torch.device("cpu"), "fp8")


def test_gpu_without_fp8_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU with FP8 support \(compute capability "
                                         r">= 8.9.*NVIDIA A100 is 8.0: use kv_cache_dtype='auto'"):
        check_fp8_kv_supported("fp8", torch.device("cuda"))
    check_fp8_kv_supported("auto", torch.device("cuda"))  # nothing to check
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_kv_supported("fp8_e5m2", torch.device("cuda"))


def test_inspect_cache_reports_fp8_blocks(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": list(range(1, 40))}) + "\n")
    reports = {}
    for kv in ("auto", "fp8"):
        result = CliRunner().invoke(app, ["inspect-cache", str(path), "--model", "tiny-qwen3", "--block-size", "4",
                                          "--dtype", "bfloat16", "--kv-cache-dtype", kv, "--json"])
        assert result.exit_code == 0, result.stderr
        reports[kv] = json.loads(result.stdout)
    auto, fp8 = reports["auto"], reports["fp8"]
    assert (auto["kv_cache_dtype"], auto["dtype_bytes"], auto["bytes_per_block"]) == ("bfloat16", 2, 2048)
    assert (fp8["kv_cache_dtype"], fp8["dtype_bytes"], fp8["bytes_per_block"]) == ("float8_e4m3fn", 1, 1024)
    assert fp8["num_blocks"] == 2 * auto["num_blocks"] and fp8["cache_bytes"] == auto["cache_bytes"]
    table = CliRunner().invoke(app, ["inspect-cache", str(path), "--model", "tiny-qwen3", "--block-size", "4",
                                     "--kv-cache-dtype", "fp8"])
    assert table.exit_code == 0 and "4 / 1,024 (float8_e4m3fn)" in table.stdout
    bad = CliRunner().invoke(app, ["inspect-cache", str(path), "--model", "tiny-qwen3", "--kv-cache-dtype", "int4"])
    assert bad.exit_code == 2 and "kv_cache_dtype='int4'" in bad.stderr


def test_fp8_weights_and_fp8_cache_together():
    """Both FP8 paths at once: the prompt logprobs against the fp32 engine's (measured at most 0.114 on
    tiny-qwen3, against 0.079 with FP8 weights alone), and the cost model's weight and KV bytes shrink."""
    prompts = _prompts()
    engine_args = dict(load_format="dummy", max_model_len=256, max_num_batched_tokens=64, cpu_kv_cache_bytes=1 << 24)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    with LLM("tiny-qwen3", quantization="fp8", kv_cache_dtype="fp8", **engine_args) as llm:
        fp8_info, fp8_outputs = llm.info, llm.generate(prompts, params)
    with LLM("tiny-qwen3", **engine_args) as llm:
        info, outputs = llm.info, llm.generate(prompts, params)
    assert fp8_info.quantization.startswith("fp8") and fp8_info.kv_cache_dtype == "float8_e4m3fn"
    assert fp8_info.costs.kv_bytes_per_token * 4 == info.costs.kv_bytes_per_token  # fp32 model: 4 bytes -> 1
    assert fp8_info.costs.weights.shared_bytes < info.costs.weights.shared_bytes / 2
    diff = max(abs(a.prompt_logprobs[i][p[i]].logprob - b.prompt_logprobs[i][p[i]].logprob)
               for a, b, p in zip(fp8_outputs, outputs, prompts) for i in range(1, len(p)))
    assert 0 < diff <= 0.25, f"logprobs differ by up to {diff:.3f}"
