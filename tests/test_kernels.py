"""Triton attention kernels against the torch reference on fresh random inputs.

Without CUDA the kernels run in Triton's interpreter (on the CPU, small shapes); the `gpu` tests take real
shapes and run only on a CUDA device (`pytest -m gpu`)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Read when a kernel is decorated: before the first import of a kernel module, as here at collection time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.attention.kv_quant import dequantize, quantize
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend, paged_attention
from nanovllm.attention.triton_backend import TritonAttentionBackend
from nanovllm.kernels.decode_attention import (
    MAX_SPLITS,
    DecodeConfig,
    choose_num_splits,
    paged_decode_attention,
)
from nanovllm.kernels.fp8_formats import is_fp8
from nanovllm.kernels.kv_cache import store_kvcache
from nanovllm.kernels.prefill_attention import PrefillConfig, paged_prefill_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative L2 error against an fp32 reference on upcast inputs; on the GPU an fp32 tl.dot runs in TF32.
TOLERANCE = {torch.float32: 1e-3 if DEVICE.type == "cuda" else 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Triton's interpreter multiplies the raw bits of bf16 operands in tl.dot (triton-lang/triton#11584).
needs_bf16_dot = pytest.mark.skipif(DEVICE.type == "cpu", reason="Triton's interpreter has no bf16 tl.dot")


class Batch:
    """One step's inputs over a paged cache: `lens` holds (cached, new) tokens per sequence.

    Block ids are shuffled from a pool twice the size needed (holes between sequences); every cache slot that no
    sequence holds is NaN, so a kernel that reads or leaves one shows it. `share`: sequence 1's first full cached
    blocks are sequence 0's. `recompute`: sequences whose one new token is already in the cache (a fully cached
    prompt recomputes its last token): its slot is -1, and the K/V passed for it differ from the cached ones.
    `kv_dtype`: the caches' type when it is not `dtype` (FP8, with scales `k_scale` / `v_scale`)."""

    def __init__(self, lens: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, seed: int, share: bool = False, recompute: tuple[int, ...] = (),
                 kv_dtype: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
        gen = torch.Generator().manual_seed(seed)
        kv_dtype = kv_dtype or dtype
        self.k_scale, self.v_scale = k_scale, v_scale

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        seq_lens = [cached + new for cached, new in lens]
        counts = [-(-n // block_size) for n in seq_lens]
        num_blocks = 2 * sum(counts) + 1
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [[pool.pop() for _ in range(count)] for count in counts]
        if share:
            shared = min(lens[0][0], lens[1][0]) // block_size
            assert shared >= 1
            tables[1][:shared] = tables[0][:shared]
        block_tables = torch.full((len(lens), max(counts) + 1), -1, dtype=torch.int32)  # a -1 column past all
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)

        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        cached_slots, slots = [], []
        for i, ((cached, new), table) in enumerate(zip(lens, tables)):
            seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(cached + new)]
            cached_slots += seq_slots[:cached + (new if i in recompute else 0)]
            if i in recompute:
                assert new == 1
                slots.append(-1)
            else:
                slots += seq_slots[cached:]
        # The cached values before rounding (fp32; shared blocks are written twice, the exact and the quantized
        # cache must keep the same write), then the caches of kv_dtype made from them.
        self.exact_caches = []
        for _ in range(2):
            exact = torch.full(cache_shape, float("nan"))
            exact.view(-1, num_kv_heads, head_dim)[cached_slots] = randn(len(cached_slots), num_kv_heads, head_dim).float()
            self.exact_caches.append(exact)
        self.k_cache = quantize(self.exact_caches[0], k_scale, kv_dtype)
        self.v_cache = quantize(self.exact_caches[1], v_scale, kv_dtype)
        num_tokens = len(slots)
        # q/k/v as views of one projection, like the model's, so the kernels see their real strides.
        qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        self.q = q.view(num_tokens, num_heads, head_dim)
        self.k = k.view(num_tokens, num_kv_heads, head_dim)
        self.v = v.view(num_tokens, num_kv_heads, head_dim)
        if is_fp8(kv_dtype) and DEVICE.type == "cpu":  # values the interpreter's FP8 cast stores exactly
            self.k.copy_(dequantize(quantize(self.k, k_scale, kv_dtype), k_scale))
            self.v.copy_(dequantize(quantize(self.v, v_scale, kv_dtype), v_scale))
        query_start = [0]
        for _, new in lens:
            query_start.append(query_start[-1] + new)
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            max_query_len=max(new for _, new in lens),
            max_seq_len=max(seq_lens),
        )
        self.scale = head_dim ** -0.5
        self.to(DEVICE)

    def to(self, device: torch.device) -> None:
        for name in ("q", "k", "v", "k_cache", "v_cache"):
            setattr(self, name, getattr(self, name).to(device))
        meta = self.meta
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, name, getattr(meta, name).to(device))

    @property
    def scales(self) -> dict[str, float]:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def reference(self, window: int | None = None, softcap: float | None = None, quantized: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 output and caches of the torch backend on upcast copies of the inputs; an FP8 cache stays FP8
        (quantized on store, dequantized to fp32 on read) unless `quantized` is False (then the step's new K/V
        are not rounded: the exact attention over the cached values)."""
        scales = {}
        if not is_fp8(self.k_cache.dtype):
            k_cache, v_cache = self.k_cache.float(), self.v_cache.float()
        elif quantized:
            k_cache, v_cache, scales = self.k_cache.clone(), self.v_cache.clone(), self.scales
        else:
            k_cache, v_cache = (c.to(DEVICE, copy=True) for c in self.exact_caches)
        out = TorchAttentionBackend().forward(self.q.float(), self.k.float(), self.v.float(), k_cache, v_cache,
                                              self.meta, self.scale, window=window, softcap=softcap, **scales)
        return out, k_cache, v_cache

    def store(self, ref_k_cache: torch.Tensor, ref_v_cache: torch.Tensor) -> None:
        """Our store kernel; the caches must then equal the reference's bit for bit, NaN where nothing wrote."""
        store_kvcache(self.k, self.v, self.k_cache, self.v_cache, self.meta.slot_mapping, **self.scales)
        torch.testing.assert_close(self.k_cache.float(), ref_k_cache.float(), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(self.v_cache.float(), ref_v_cache.float(), rtol=0, atol=0, equal_nan=True)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.isfinite().all(), "NaN/inf in the output: an element was left unwritten or read a poisoned slot"
    error = ((out.float() - ref).norm() / ref.norm()).item()
    assert error <= TOLERANCE[out.dtype], f"relative error {error:.2e} > {TOLERANCE[out.dtype]:.0e}"


def run_prefill(batch: Batch, config: PrefillConfig | None = None, **limits) -> torch.Tensor:
    """`limits`: window / softcap, given to the reference and the kernel alike."""
    ref, ref_k, ref_v = batch.reference(**limits)
    if limits:  # the case must exercise them: without, the reference differs
        assert (batch.reference()[0] - ref).abs().nan_to_num(1.0).max() > 1e-2  # NaN: it read a dropped block
    batch.store(ref_k, ref_v)
    out = torch.full_like(batch.q, float("nan"))
    meta = batch.meta
    paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, meta.query_start_loc, meta.seq_lens,
                            meta.block_tables, meta.max_query_len, batch.scale, out=out, config=config, **limits,
                            **batch.scales)
    assert_matches(out, ref)
    return out


def run_decode(batch: Batch, num_splits: int, config: DecodeConfig | None = None, **limits) -> torch.Tensor:
    ref, ref_k, ref_v = batch.reference(**limits)
    if limits:  # the case must exercise them: without, the reference differs
        assert (batch.reference()[0] - ref).abs().nan_to_num(1.0).max() > 1e-2  # NaN: it read a dropped block
    batch.store(ref_k, ref_v)
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens,
                           batch.scale, num_splits, out=out, config=config, **limits, **batch.scales)
    assert_matches(out, ref)
    return out


# ---- CPU (interpreter) and GPU: small shapes ------------------------------------------------------------------

SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
SMALL_DECODE = DecodeConfig(block_n=16, num_warps=4, num_stages=2)
# (block_size, num_heads, num_kv_heads, head_dim, dtype)
SHAPES = [
    pytest.param(16, 2, 2, 64, torch.float16, id="bs16-mha-d64-fp16"),
    pytest.param(32, 4, 2, 128, torch.float32, id="bs32-gqa2-d128-fp32"),
    pytest.param(16, 6, 2, 64, torch.float32, id="bs16-gqa3-d64-fp32"),
    pytest.param(64, 4, 2, 64, torch.float16, id="bs64-gqa2-d64-fp16"),
    pytest.param(128, 6, 2, 128, torch.float16, id="bs128-gqa3-d128-fp16"),
    pytest.param(256, 4, 2, 64, torch.float32, id="bs256-gqa2-d64-fp32"),
    pytest.param(16, 4, 2, 128, torch.bfloat16, id="bs16-gqa2-d128-bf16", marks=needs_bf16_dot),
]


def test_store_skips_minus_one_slots():
    for dtype in (torch.bfloat16, torch.float16):
        batch = Batch([(5, 9), (16, 1), (0, 3)], 8, 6, 3, 64, dtype, seed=1, recompute=(1,))
        batch.meta.slot_mapping[2] = -1  # and one more skipped token in the middle of a chunk
        _, ref_k, ref_v = batch.reference()
        batch.store(ref_k, ref_v)


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), SHAPES)
def test_prefill_ragged_with_cached_prefixes(block_size, num_heads, num_kv_heads, head_dim, dtype):
    """Fresh prefills, chunks continuing mid-block after cached prefixes, a fully cached prompt recomputing its
    last token (slot -1), a decode-like one-token chunk, and two sequences sharing prefix blocks."""
    unit = min(block_size, 32)  # bounds the chunks the interpreter has to run through at large block sizes
    lens = [(block_size + 7, 20), (block_size + 3, 2 * unit - 5), (2 * block_size, 1), (40, 1), (0, 37)]
    batch = Batch(lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=2, share=True, recompute=(2,))
    run_prefill(batch, SMALL_PREFILL)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=needs_bf16_dot)])
def test_prefill_default_config(dtype):
    """The GPU's tile sizes: one tile holds a whole short chunk; GQA 3 leaves rows of the tile unused."""
    batch = Batch([(0, 70), (30, 50), (90, 1)], 32, 6, 2, 64, dtype, seed=3)
    run_prefill(batch)


@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_ragged(block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits):
    lens = [(block_size * 3 + 5, 1), (2 * block_size - 1, 1), (0, 1), (16, 1), (70, 1)]
    batch = Batch(lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=4, share=True)
    run_decode(batch, num_splits, SMALL_DECODE)


def test_decode_more_splits_than_tiles():
    """Splits past a short sequence's end are empty; the merge must ignore them."""
    batch = Batch([(3, 1), (40, 1), (0, 1)], 16, 4, 1, 64, torch.float16, seed=5)
    run_decode(batch, 8, SMALL_DECODE)
    run_decode(Batch([(100, 1), (9, 1)], 16, 4, 1, 64, torch.float16, seed=6), 2)  # default tiles


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_empty_rows_give_zeros(num_splits):
    """A row of seq_len 0 reads nothing and yields zeros (a safe padding row); the other rows are unaffected."""
    batch = Batch([(20, 1), (5, 1)], 16, 4, 2, 64, torch.float16, seed=7)
    ref, ref_k, ref_v = batch.reference()
    batch.store(ref_k, ref_v)
    batch.meta.seq_lens[1] = 0
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables, batch.meta.seq_lens,
                           batch.scale, num_splits, out=out, config=SMALL_DECODE)
    assert_matches(out[:1], ref[:1])
    assert not out[1].any()


# (window, softcap): Mistral-like window only, Gemma-2-like window with capping, capping alone; a window of 1
# (a token sees only itself) and windows that are not multiples of the tile or the page.
LIMITS = [pytest.param(dict(window=24), id="window24"), pytest.param(dict(window=7, softcap=5.0), id="window7-cap5"),
          pytest.param(dict(softcap=2.0), id="cap2"), pytest.param(dict(window=1), id="window1")]


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), [
    pytest.param(16, 6, 2, 64, torch.float32, id="bs16-gqa3-d64-fp32"),
    pytest.param(8, 4, 2, 32, torch.float16, id="bs8-gqa2-d32-fp16")])
def test_prefill_window_softcap(limits, block_size, num_heads, num_kv_heads, head_dim, dtype):
    """Chunks after cached prefixes longer than the window (whole tiles and pages fall out of it), a fresh prompt
    longer than the window, a recomputed last token and a decode-like chunk; shared prefix blocks."""
    lens = [(block_size + 7, 20), (45, 19), (2 * block_size, 1), (40, 1), (0, 37)]
    batch = Batch(lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=13, share=True, recompute=(2,))
    run_prefill(batch, SMALL_PREFILL, **limits)


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window_softcap(limits, num_splits):
    """Contexts shorter and longer than the window; splits over the window's range only."""
    lens = [(53, 1), (40, 1), (5, 1), (0, 1), (16, 1), (70, 1)]
    batch = Batch(lens, 16, 4, 2, 64, torch.float32, seed=14, share=True)
    run_decode(batch, num_splits, SMALL_DECODE, **limits)


def drop_blocks_before_window(batch: Batch, window: int) -> None:
    """Point every table entry whose block lies wholly before all of its sequence's windows at a block no sequence
    holds (all NaN): what a cache that frees blocks once they leave a layer's window leaves behind."""
    block_size = batch.k_cache.shape[1]
    tables = batch.meta.block_tables
    unused = sorted(set(range(batch.k_cache.shape[0])) - set(tables.flatten().tolist()))[0]
    starts = batch.meta.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.meta.seq_lens.tolist()):
        first_query = seq_len - (starts[i + 1] - starts[i])
        dropped = max(first_query - window + 1, 0) // block_size
        tables[i, :dropped] = unused


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_keys_before_the_window_are_not_read(kernel):
    if kernel == "prefill":
        batch = Batch([(45, 19), (70, 5), (0, 37), (33, 1)], 8, 4, 2, 32, torch.float32, seed=18)
        drop_blocks_before_window(batch, 12)
        run_prefill(batch, SMALL_PREFILL, window=12, softcap=4.0)
    else:
        batch = Batch([(53, 1), (40, 1), (5, 1), (70, 1)], 8, 4, 2, 32, torch.float32, seed=19)
        drop_blocks_before_window(batch, 12)
        for num_splits in (1, 3):
            run_decode(batch, num_splits, SMALL_DECODE, window=12)


def test_softcap_bounds_scores():
    """The reference's capping against scores computed by hand: cap * tanh(q.k * scale / cap), softmax, V."""
    from nanovllm.attention.torch_backend import attend

    gen = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(2, 3, 5, generator=gen) * 4 for _ in range(3))  # [heads, tokens, dim], large scores
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) * 0.5 / 3.0).tanh() * 3.0
    expected = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(attend(q, k, v, mask, 0.5, 3.0), expected)
    assert not torch.allclose(attend(q, k, v, mask, 0.5, None), expected)  # the cap changes the result here


def test_backend_routes_prefill_and_decode():
    backend = TritonAttentionBackend(DEVICE)
    prefill = Batch([(10, 30), (0, 5)], 16, 4, 2, 64, torch.float16, seed=8)
    ref, _, _ = prefill.reference()
    assert_matches(backend.forward(prefill.q, prefill.k, prefill.v, prefill.k_cache, prefill.v_cache,
                                   prefill.meta, prefill.scale), ref)
    decode = Batch([(50, 1), (7, 1), (33, 1)], 16, 4, 2, 64, torch.float16, seed=9)
    decode.meta.decode_num_splits = backend.decode_num_splits(3, decode.meta.max_seq_len, 2)
    ref, _, _ = decode.reference()
    assert_matches(backend.forward(decode.q, decode.k, decode.v, decode.k_cache, decode.v_cache, decode.meta,
                                   decode.scale), ref)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_backend_gives_a_mixed_steps_decodes_to_the_decode_kernel(num_splits):
    """A step of three decodes (one of them recomputing a cached token) then two prompt chunks: the decodes go
    through the decode kernel and the chunks through the prefill kernel, into one output equal to the reference;
    and equal to the same step run through the prefill kernel alone (num_decodes 0)."""
    backend = TritonAttentionBackend(DEVICE)
    mixed = Batch([(50, 1), (7, 1), (33, 1), (10, 30), (0, 5)], 16, 4, 2, 64, torch.float16, seed=10,
                  recompute=(1,))
    mixed.meta.num_decodes, mixed.meta.decode_num_splits = 3, num_splits
    ref, _, _ = mixed.reference()
    split = backend.forward(mixed.q, mixed.k, mixed.v, mixed.k_cache, mixed.v_cache, mixed.meta, mixed.scale)
    assert_matches(split, ref)
    mixed.meta.num_decodes = 0
    whole = backend.forward(mixed.q, mixed.k, mixed.v, mixed.k_cache, mixed.v_cache, mixed.meta, mixed.scale)
    assert_matches(whole, ref)
    torch.testing.assert_close(split, whole, atol=2e-3, rtol=0)


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 1024, 132) == 1  # 2048 programs fill the GPU
    assert choose_num_splits(8, 8, 4096, 132) == 5  # 64 programs: ~2 per SM needs 5 splits
    assert choose_num_splits(1, 8, 300, 132) == 2  # at least 256 keys per split
    assert choose_num_splits(1, 1, 1 << 20, 132) == MAX_SPLITS
    assert choose_num_splits(4, 8, 100, 132) == 1


# ---- FP8 caches ----------------------------------------------------------------------------------------------------
# The kernels read FP8 K/V converted to q's type in registers (exact: every FP8 value is a 16-bit float), with the K
# scale folded into the softmax scale and the V scale applied to the output; the reference dequantizes to fp32. Both
# see the same FP8 values, so they agree within q's type's TOLERANCE. Against exact attention over the values before
# rounding the error is the quantization's own, bounded by FP8_ATTENTION_ERROR (relative L2 on N(0, 1) inputs: about
# 0.017 for e4m3 and 0.034 for e5m2 on the CPU, where the new K/V are snapped to the grid; 0.036-0.038 and
# 0.071-0.074 on the H100's real shapes, where every value is rounded: docs/FP8.md).
# Triton's interpreter rounds wrongly when it casts to FP8 (a mantissa carry is lost: 1.97 -> 1.0; ties do not go to
# even) and reads FP8 NaN/inf bit patterns as numbers: on the CPU the step's new K/V are snapped to values the cast
# stores exactly (Batch) and the scales are powers of two; on a GPU (hardware cvt.rn.satfinite) the store is checked
# bit for bit on arbitrary values with scales that are not powers of two.

FP8_DTYPES = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
FP8_ATTENTION_ERROR = {torch.float8_e4m3fn: 0.05, torch.float8_e5m2: 0.1}
FP8_SCALES = dict(k_scale=0.5, v_scale=2.0) if DEVICE.type == "cpu" else dict(k_scale=0.37, v_scale=1.7)


def assert_quantization_error(batch: Batch, out: torch.Tensor, **limits) -> None:
    exact = batch.reference(**limits, quantized=False)[0]
    error = ((out.float() - exact).norm() / exact.norm()).item()
    bound = FP8_ATTENTION_ERROR[batch.k_cache.dtype]
    assert 0 < error <= bound, f"relative error against exact attention {error:.3f} not in (0, {bound}]"


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
def test_fp8_store_quantizes_and_saturates(kv_dtype):
    """The store kernel's FP8 caches equal the reference's bit for bit (x / scale rounded to nearest), values
    past the type's range saturate to its largest finite value (no NaN, no inf), -1 slots are skipped."""
    batch = Batch([(5, 9), (16, 1), (0, 3)], 8, 6, 3, 64, torch.float32, seed=21, recompute=(1,), kv_dtype=kv_dtype,
                  **FP8_SCALES)
    batch.meta.slot_mapping[2] = -1
    batch.k[0] *= 1e6  # far past e5m2's 57344 x scale too
    batch.v[3, 0] = -1e6
    _, ref_k, ref_v = batch.reference()
    batch.store(ref_k, ref_v)
    bound = torch.finfo(kv_dtype).max
    flat_k = batch.k_cache.view(-1, *batch.k_cache.shape[2:]).float()
    flat_v = batch.v_cache.view(-1, *batch.v_cache.shape[2:]).float()
    slot = batch.meta.slot_mapping[0]
    assert flat_k[slot].abs().max() == bound and flat_k[slot].isfinite().all()
    assert (flat_v[batch.meta.slot_mapping[3], 0] == -bound).all()


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"), [
    pytest.param(16, 6, 2, 64, torch.float32, id="bs16-gqa3-d64-fp32"),
    pytest.param(32, 4, 2, 128, torch.float16, id="bs32-gqa2-d128-fp16")])
def test_fp8_prefill(kv_dtype, block_size, num_heads, num_kv_heads, head_dim, dtype):
    lens = [(block_size + 7, 20), (block_size + 3, 27), (2 * block_size, 1), (0, 37)]
    batch = Batch(lens, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=22, share=True, recompute=(2,),
                  kv_dtype=kv_dtype, **FP8_SCALES)
    assert_quantization_error(batch, run_prefill(batch, SMALL_PREFILL))


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_decode(kv_dtype, num_splits):
    lens = [(53, 1), (31, 1), (0, 1), (16, 1), (70, 1)]
    batch = Batch(lens, 16, 4, 2, 64, torch.float16, seed=23, share=True, kv_dtype=kv_dtype, **FP8_SCALES)
    assert_quantization_error(batch, run_decode(batch, num_splits, SMALL_DECODE))


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_fp8_window_softcap(kernel):
    limits = dict(window=7, softcap=5.0)
    if kernel == "prefill":
        batch = Batch([(23, 20), (45, 19), (0, 37)], 16, 6, 2, 64, torch.float32, seed=24,
                      kv_dtype=torch.float8_e4m3fn, **FP8_SCALES)
        out = run_prefill(batch, SMALL_PREFILL, **limits)
    else:
        batch = Batch([(53, 1), (5, 1), (70, 1)], 16, 4, 2, 64, torch.float32, seed=25,
                      kv_dtype=torch.float8_e4m3fn, **FP8_SCALES)
        out = run_decode(batch, 3, SMALL_DECODE, **limits)
    assert_quantization_error(batch, out, **limits)


def test_fp8_backend_routes_scales():
    """The Triton backend passes a layer's scales to the store and both kernels."""
    backend = TritonAttentionBackend(DEVICE)
    for lens, seed in (([(10, 30), (0, 5)], 26), ([(50, 1), (7, 1)], 27)):
        batch = Batch(lens, 16, 4, 2, 64, torch.float16, seed=seed, kv_dtype=torch.float8_e4m3fn, **FP8_SCALES)
        batch.meta.decode_num_splits = backend.decode_num_splits(2, batch.meta.max_seq_len, 2)
        ref, _, _ = batch.reference()
        assert_matches(backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta,
                                       batch.scale, **batch.scales), ref)


# ---- GPU: real shapes -------------------------------------------------------------------------------------------

QWEN3_06B = (16, 8, 128)  # query heads, KV heads, head dim


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [QWEN3_06B, (24, 8, 64), (8, 8, 128)], ids=["qwen3", "gqa3-d64", "mha"])
@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_gpu_real_shapes(kernel, heads, dtype, block_size):
    if kernel == "prefill":
        # 8k tokens: chunks after long cached prefixes (two sharing blocks), whole prompts, decodes in the mix,
        # a recomputed last token
        lens = [(3000, 1500), (block_size * 7 + 3, 2048), (0, 1024), (0, 777), (1000, 1), (2048, 1), (0, 2000),
                (4096 + 5, 841)]
        batch = Batch(lens, block_size, *heads, dtype, seed=10, share=True, recompute=(4,))
        run_prefill(batch)
    else:
        context = [4000, 3000] + torch.randint(1, 4096, (62,), generator=torch.Generator().manual_seed(0)).tolist()
        batch = Batch([(n - 1, 1) for n in context], block_size, *heads, dtype, seed=11, share=True)
        ref, ref_k, ref_v = batch.reference()
        batch.store(ref_k, ref_v)
        for num_splits in (1, choose_num_splits(64, heads[1], 4096, 132), 16):
            out = torch.full_like(batch.q, float("nan"))
            paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                                   batch.meta.seq_lens, batch.scale, num_splits, out=out)
            assert_matches(out, ref)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [1, 8])
def test_gpu_decode_cuda_graph_replay(num_splits):
    """Captured once, replayed on other contexts written into the same buffers: same as the reference."""
    num_heads, num_kv_heads, head_dim = QWEN3_06B
    lens = [(n, 1) for n in (100, 3000, 17, 2047)]
    batch = Batch(lens, 16, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=12)
    out = torch.empty_like(batch.q)
    seq_lens, block_tables, q = batch.meta.seq_lens.clone(), batch.meta.block_tables.clone(), batch.q.clone()

    def decode():
        paged_decode_attention(q, batch.k_cache, batch.v_cache, block_tables, seq_lens, batch.scale, num_splits,
                               out=out)

    _, ref_k, ref_v = batch.reference()
    batch.store(ref_k, ref_v)
    decode()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    # Shorter contexts in the same tables, new queries: only buffer contents change.
    batch.meta.seq_lens -= torch.tensor([90, 1000, 10, 2000], dtype=torch.int32, device=DEVICE)
    batch.q.normal_()
    seq_lens.copy_(batch.meta.seq_lens)
    q.copy_(batch.q)
    out.fill_(float("nan"))
    graph.replay()
    assert_matches(out, paged_attention(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), batch.meta,
                                        batch.scale))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("limits", [dict(window=4096), dict(window=1000, softcap=50.0), dict(window=128)],
                         ids=["window4096", "window1000-cap50", "window128"])
@pytest.mark.parametrize("heads", [QWEN3_06B, (8, 4, 256)], ids=["qwen3", "gemma-d256"])
@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_gpu_window_softcap_real_shapes(kernel, heads, limits):
    """Windows and soft-capping at real sizes in bf16, Gemma's 256-wide heads included (their own tile sizes)."""
    if kernel == "prefill":
        lens = [(5000, 1500), (16 * 7 + 3, 2048), (0, 1024), (1000, 1), (0, 2000), (4096 + 5, 841)]
        run_prefill(Batch(lens, 16, *heads, torch.bfloat16, seed=16, share=True), **limits)
    else:
        context = [6000, 3000] + torch.randint(1, 8192, (30,), generator=torch.Generator().manual_seed(1)).tolist()
        batch = Batch([(n - 1, 1) for n in context], 16, *heads, torch.bfloat16, seed=17, share=True)
        for num_splits in (1, 8):
            run_decode(batch, num_splits, **limits)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_gpu_fp8_real_shapes(kernel, block_size, kv_dtype):
    """FP8 caches under bf16 queries at Qwen3's shape: the same as the dequantizing reference, and within the
    quantization's bound of exact attention."""
    if kernel == "prefill":
        lens = [(3000, 1500), (block_size * 7 + 3, 2048), (0, 1024), (1000, 1), (0, 2000)]
        batch = Batch(lens, block_size, *QWEN3_06B, torch.bfloat16, seed=28, share=True, kv_dtype=kv_dtype,
                      **FP8_SCALES)
        assert_quantization_error(batch, run_prefill(batch))
    else:
        context = [4000, 3000] + torch.randint(1, 4096, (62,), generator=torch.Generator().manual_seed(2)).tolist()
        batch = Batch([(n - 1, 1) for n in context], block_size, *QWEN3_06B, torch.bfloat16, seed=29, share=True,
                      kv_dtype=kv_dtype, **FP8_SCALES)
        for num_splits in (1, 8):
            assert_quantization_error(batch, run_decode(batch, num_splits))
