"""Kernels compile for sm_90 (Hopper), even on a machine without a GPU: sampling, logprobs, penalties and the
other logit controls, the KV store into
16-bit and FP8 caches, the decode and prefill attention kernels reading either (and fp32, with IEEE dots), and the
LoRA shrink and expand at their widest tiles within the shared memory of one program.

Triton's interpreter, which runs the kernel tests on the CPU, accepts code that the compiler rejects (a module
global that is not a constexpr, a variable whose type changes inside a branch): compiling ahead of time with
Triton's bundled ptxas catches those before a GPU run does (the FP8 store once branched on a float constexpr,
which only the compiler rejects)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

COMPILE = r"""
import os
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import nanovllm.kernels.decode_attention as D
import nanovllm.kernels.kv_cache as K
import nanovllm.kernels.logprobs as LP
import nanovllm.kernels.logit_controls as C
import nanovllm.kernels.lora as L
import nanovllm.kernels.penalties as P2
import nanovllm.kernels.prefill_attention as P
import nanovllm.kernels.sampling as S

HOPPER_SHARED_BYTES = 232448  # the most shared memory one program may use on an H100 (227 KiB)

def build(fn, signature, constexprs, num_warps, aligned, num_stages=3):
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    assert kernel.asm["cubin"], fn.__name__
    # a launch would fail with OutOfResources past this; the compile alone does not say so
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, (fn.__name__, constexprs, num_stages, kernel.metadata.shared)

sample_args = ["logits", "stride", "out", "temperatures", "top_k", "top_p", "min_p", "seeds", "positions",
               "scratch", "counters", "vocab", "G"]
sample_types = ["*bf16", "i32", "*i64", "*fp32", "*i64", "*fp32", "*fp32", "*i64", "*i64", "*i64", "*i32", "i32", "i32"]
for kernel, constexprs in (
        (S._sample_kernel, dict(BLOCK=S.DEFAULT_BLOCK, NARROW=S.NARROW_K, CHUNK=S.CHUNK, PIVOTS=S.PIVOTS)),
        (S._sample_wide_kernel, dict(BLOCK=S.DEFAULT_BLOCK, CHUNK=S.CHUNK, PIVOTS=S.PIVOTS,
                                     SEARCH_PIVOTS=S.PIVOTS_SEARCH, SEARCH_CAP=S.SEARCH_CAP, MAX_PASSES=S.MAX_PASSES))):
    signature = dict(zip(sample_args, sample_types), **dict.fromkeys(constexprs, "constexpr"))
    build(kernel, signature, constexprs, S.DEFAULT_WARPS, sample_args)
penalty_args = P2._penalties_kernel.arg_names[:-1]
signature = dict(zip(penalty_args, ["*fp32", "i32", "*i64", "*i64", "*fp32", "*fp32", "*fp32", "*i32", "i32", "*i32",
                                    "*i32", "i32"]), BLOCK="constexpr")
build(P2._penalties_kernel, signature, {"BLOCK": 1024}, 4, ["logits", "stride"])
segment_args = LP._segment_kernel.arg_names[:10]
signature = dict(zip(segment_args, ["*bf16", "i32", "*i64", "*fp32", "*fp32", "*i32", "*i64", "i32", "i32", "i32"]),
                 SEGMENT="constexpr", MAX_TOP="constexpr")
build(LP._segment_kernel, signature, {"SEGMENT": LP.SEGMENT, "MAX_TOP": LP.MAX_TOP}, LP.SEGMENT_WARPS, segment_args)
combine_args = LP._combine_kernel.arg_names[:14]
signature = dict(zip(combine_args, ["*bf16", "i32", "*i64", "*fp32", "*fp32", "*i32", "*i64", "*fp32", "*i64", "*fp32",
                                    "*i64", "*fp32", "i32", "i32"]), SEGMENTS="constexpr", MAX_TOP="constexpr")
build(LP._combine_kernel, signature, {"SEGMENTS": 256, "MAX_TOP": LP.MAX_TOP}, 4, combine_args)
build(C._record_kernel, dict(zip(C._record_kernel.arg_names, ["*i64"] * 3 + [
    "*i32", "i32", "*i1", "i32", "*i32", "i32", "*i32", "*i64", "i32", "*i64"]), WINDOW_BLOCK="constexpr"),
      {"WINDOW_BLOCK": 8}, 1, [])  # one warp, as it runs
for kernel, types, constexprs in (
        (C._batch_index_kernel, ["*i64", "i32", "*i64", "i32"], {"BLOCK": 1024}),
        (C._bad_words_kernel, ["*fp32", "i32"] + ["*i64"] * 5 + ["i32", "*i64", "i32"],
         {"BLOCK": C.WORD_BLOCK, "WINDOW_BLOCK": 8}),
        (C._min_tokens_kernel, ["*fp32", "i32"] + ["*i64"] * 4 + ["i32", "*i64"], {"BLOCK": C.ENTRY_BLOCK}),
        (C._bias_kernel, ["*fp32", "i32"] + ["*i64"] * 3 + ["*fp32", "i32"], {"BLOCK": C.ENTRY_BLOCK})):
    signature = dict(zip(kernel.arg_names, types), **dict.fromkeys(constexprs, "constexpr"))
    build(kernel, signature, constexprs, 4, [])
store_args = K._store_kvcache_kernel.arg_names[:17]
for cache, fp8_max in (("*bf16", 0.0), ("*fp8e4nv", 448.0), ("*fp8e5", 57344.0)):
    signature = dict(zip(store_args, ["*bf16", "*bf16", cache, cache, "*i64", "fp32", "fp32"] + ["i32"] * 10))
    constexprs = {"NUM_KV_HEADS": 8, "BLOCK_H": 8, "HEAD_DIM": 128, "PAGE": 16, "FP8_MAX": fp8_max, "PDL": False}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    build(K._store_kvcache_kernel, signature, constexprs, 4, [])
for cache in ("*bf16", "*fp8e4nv", "*fp8e5", "*fp32"):  # fp32: the fp32 mode's IEEE dots
    fp8, fp32 = cache in ("*fp8e4nv", "*fp8e5"), cache == "*fp32"
    for kernel, pointers, extra in ((D._decode_kernel, 8, {"BLOCK_H": 16, "SPLIT": False}),
                                    (P._prefill_kernel, 7, {"BLOCK_M": 128})):
        names = kernel.arg_names
        constexprs = {name: value for name, value in dict(
            GROUP=2, HEAD_DIM=128, PAGE=16, BLOCK_N=128 if fp8 else 64, WINDOW=False, SOFTCAP=False,
            FP16_DOTS=fp8, PRECISION="ieee" if fp32 else "tf32", PDL=False, **extra).items() if name in names}
        types = ["*fp32" if fp32 else "*bf16", cache, cache] + ["*fp32"] * (pointers - 3)  # q, caches, outputs, ...
        types = [t if name not in ("block_tables", "seq_lens", "query_start_loc") else "*i32"
                 for name, t in zip(names, types)]
        types += ["fp32", "fp32", "i32", "fp32"] + ["i32"] * 11  # scales, window, softcap, strides
        signature = dict(zip(names, types))
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        build(kernel, signature, constexprs, 4, [])
# LoRA at its widest tiles (rank tiles of 64, 8 splits, 64-row blocks: max_lora_rank 64 to 256), the stages
# add_lora launches them with
tiles = L.LoRATiles(block_r=64, block_k=64, block_n=64, split_k=8)
shrink_types = ["*bf16", "*bf16", "*fp32", "*i32", "*i32", "*i32"] + ["i32"] * 10
constexprs = dict(BLOCK_M=64, BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k, PRECISION="tf32")
signature = dict(zip(L._shrink_kernel.arg_names, shrink_types), **dict.fromkeys(constexprs, "constexpr"))
build(L._shrink_kernel, signature, constexprs, tiles.num_warps, [], tiles.num_stages)
expand_types = ["*fp32", "*bf16", "*bf16", "*i32", "*i32", "*i32", "*i32"] + ["i32"] * 8
constexprs = dict(BLOCK_M=64, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_r, SPLIT_K=tiles.split_k, PRECISION="tf32")
signature = dict(zip(L._expand_kernel.arg_names, expand_types), **dict.fromkeys(constexprs, "constexpr"))
build(L._expand_kernel, signature, constexprs, tiles.num_warps, [], L.expand_stages(64, tiles, 2))
print("compiled")
"""


def test_kernels_compile_for_hopper():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's NVIDIA backend has no bundled ptxas here")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
