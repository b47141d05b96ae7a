"""The sampling rule (torch path, the CPU's sampler and the kernel's oracle): its distribution against the exact
filtered one, its noise, greedy rows, and the engine's guarantee that seeded rows ignore the rest of the batch."""
import math

import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.noise import gumbel_noise
from nanovllm.layers import logit_controls, sampler
from nanovllm.layers.sampler import reference_sample, sample, warm_up_logits, warm_up_rows, warm_up_sampling
from nanovllm.runner.inputs import SamplingTensors

LOGITS = [2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0]


def exact_distribution(logits, temperature, top_k, top_p, min_p):
    """Hand-rolled reference: softmax at temperature, keep top-k, then the smallest top-p nucleus of the top-k
    mass, and tokens with at least min_p times the top probability; renormalise."""
    weights = [math.exp(x / temperature) for x in logits]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    kept_mass = sum(probs[i] for i in keep)
    cumulative = 0.0
    nucleus = set()
    for i in order:
        if i not in keep:
            continue
        if cumulative >= top_p:
            break
        nucleus.add(i)
        cumulative += probs[i] / kept_mass
    final = {i for i in nucleus if probs[i] >= min_p * probs[order[0]]}
    mass = sum(probs[i] for i in final)
    return [probs[i] / mass if i in final else 0.0 for i in range(len(probs))]


def settings_tensors(n, vocab, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed_offset=3):
    return SamplingTensors(
        temperatures=torch.full((n,), temperature), top_k=torch.full((n,), top_k if top_k > 0 else vocab),
        top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p),
        seeds=torch.arange(n, dtype=torch.int64) * 7919 + seed_offset,
        sample_positions=torch.arange(n, dtype=torch.int64) % 13, all_greedy=False,
        any_filter=top_k > 0 or top_p < 1 or min_p > 0)


def chi_square_critical(dof: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at the normal quantile z (3.719: p = 1e-4)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.3, top_k=5, top_p=0.9),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.9, top_k=6, top_p=0.95, min_p=0.05),
    dict(temperature=0.5, top_p=0.6, min_p=0.3),
])
def test_chi_square_against_the_exact_filtered_distribution(settings):
    n = 40000
    tokens = sample(torch.tensor([LOGITS] * n), settings_tensors(n, len(LOGITS), **settings))
    observed = torch.bincount(tokens, minlength=len(LOGITS)).double()
    exact = torch.tensor(exact_distribution(LOGITS, settings.get("temperature", 1.0), settings.get("top_k", -1),
                                            settings.get("top_p", 1.0), settings.get("min_p", 0.0)),
                         dtype=torch.double)
    assert torch.all(observed[exact == 0] == 0), "a filtered-out token was drawn"
    support = exact > 0
    expected = exact[support] * n
    statistic = (((observed[support] - expected) ** 2) / expected).sum().item()
    dof = int(support.sum()) - 1
    if dof == 0:
        return  # a single kept token: the check above is the whole test
    assert statistic < chi_square_critical(dof), (statistic, observed, expected)


def test_mixed_rows_in_one_batch_follow_their_own_settings():
    """Rows of different settings share a batch: each row's frequencies follow its own exact distribution."""
    mixes = [dict(temperature=1.0, top_k=2), dict(temperature=0.8, top_p=0.7), dict(temperature=1.0, min_p=0.4)]
    n = 12000
    parts = [settings_tensors(n, len(LOGITS), seed_offset=1000 * i, **mix) for i, mix in enumerate(mixes)]
    batch = SamplingTensors(*(torch.cat([getattr(p, f) for p in parts]) for f in
                              ("temperatures", "top_k", "top_p", "min_p", "seeds", "sample_positions")),
                            all_greedy=False, any_filter=True)
    tokens = sample(torch.tensor([LOGITS] * (n * len(mixes))), batch).view(len(mixes), n)
    for mix, row_tokens in zip(mixes, tokens):
        exact = torch.tensor(exact_distribution(LOGITS, mix["temperature"], mix.get("top_k", -1),
                                                mix.get("top_p", 1.0), mix.get("min_p", 0.0)), dtype=torch.double)
        observed = torch.bincount(row_tokens, minlength=len(LOGITS)).double()
        assert torch.all(observed[exact == 0] == 0)
        support = exact > 0
        statistic = (((observed[support] - exact[support] * n) ** 2) / (exact[support] * n)).sum().item()
        assert statistic < chi_square_critical(int(support.sum()) - 1), (mix, observed)


def test_gumbel_noise_is_standard_gumbel_and_a_function_of_seed_and_position():
    seeds = torch.arange(64, dtype=torch.int64) - 20  # negative seeds hash too
    positions = torch.zeros(64, dtype=torch.int64)
    noise = gumbel_noise(seeds, positions, 4096)
    assert abs(noise.mean().item() - 0.5772157) < 0.01
    assert abs(noise.var().item() - math.pi ** 2 / 6) < 0.03
    assert torch.equal(noise, gumbel_noise(seeds, positions, 4096))
    assert torch.equal(noise[5:9], gumbel_noise(seeds[5:9], positions[5:9], 4096))
    assert not torch.equal(noise, gumbel_noise(seeds, positions + 1, 4096))
    assert not torch.equal(noise[:1], gumbel_noise(seeds[:1] + (1 << 32), positions[:1], 4096))


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50)
    t = SamplingTensors(temperatures=torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]),
                        top_k=torch.full((6,), 50), top_p=torch.ones(6), min_p=torch.zeros(6),
                        seeds=torch.arange(6), sample_positions=torch.zeros(6, dtype=torch.int64),
                        all_greedy=False, any_filter=False)
    tokens = sample(logits, t)
    assert torch.equal(tokens[::2], logits[::2].argmax(dim=-1))


def test_top_k_keeps_ties_at_the_kth_logit():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0]] * 3000)
    tokens = sample(logits, settings_tensors(3000, 6, temperature=1.0, top_k=2))
    assert set(tokens.tolist()) == {0, 1, 2, 3}


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=128, seed=1)


def test_seeded_request_is_independent_of_batch_composition(tiny_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True, seed=1234)
    other = SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)
    prompt = [11, 12, 13, 14, 15]
    alone = tiny_llm.generate([prompt], seeded)[0].token_ids
    batch = tiny_llm.generate([[1, 2, 3] * 9, prompt, [40] * 20],
                              [other, seeded, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])
    reordered = tiny_llm.generate([prompt, [7, 8]], [seeded, other])
    assert batch[1].token_ids == alone
    assert reordered[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, ignore_eos=True, seed=99)
    assert tiny_llm.generate([prompt], different_seed)[0].token_ids != alone


def test_unseeded_requests_follow_the_engine_seed(tiny_model_dirs):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=64, seed=7)
        runs.append([o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], params)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


@pytest.mark.parametrize("all_greedy", [True, False])
def test_bf16_logits_sample_as_their_float32_widening(all_greedy):
    """The runner hands the sampler the model's bf16 logits: the outcome must be that of the exact fp32 copy."""
    n, vocab = 16, 300
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    temperatures = torch.zeros(n) if all_greedy else torch.linspace(0, 1.5, n)  # row 0 greedy either way
    t = SamplingTensors(temperatures=temperatures, top_k=torch.full((n,), 50), top_p=torch.full((n,), 0.9),
                        min_p=torch.full((n,), 0.01), seeds=torch.arange(n), sample_positions=torch.arange(n),
                        all_greedy=all_greedy, any_filter=not all_greedy)
    assert torch.equal(sample(logits, t), sample(logits.float(), t))
    assert torch.equal(sample(logits, t)[0], logits[0].float().argmax())
    assert torch.equal(sample(logits, t), reference_sample(logits, t))


def test_warm_up_runs_the_kernels_it_warms_and_they_agree_with_the_torch_paths(monkeypatch):
    """warm_up_sampling with the kernels forced on (Triton's interpreter on the CPU): every sampler path on both
    logits dtypes draws the torch path's tokens, the penalties kernel gives the torch path's logits, the logprobs
    are log_softmax's, and the mask disallows exactly the ids past its words on the row it names."""
    vocab = 2048
    cpu = torch.device("cpu")
    pytest.importorskip("triton")
    monkeypatch.setattr(sampler, "_use_kernel", lambda logits: True)
    monkeypatch.setattr(logit_controls, "_use_kernel", lambda logits: True)
    results = warm_up_sampling(cpu, vocab, torch.bfloat16)
    monkeypatch.undo()
    settings = warm_up_rows(cpu, vocab)
    for dtype in (torch.bfloat16, torch.float32):
        logits = warm_up_logits(cpu, vocab, dtype)
        assert torch.equal(results[f"tokens_{str(dtype).removeprefix('torch.')}"], reference_sample(logits, settings))
    torch_path = warm_up_sampling(cpu, vocab, torch.bfloat16)
    assert torch.equal(results["controlled_logits"], torch_path["controlled_logits"])
    assert not torch.equal(results["controlled_logits"], warm_up_logits(cpu, vocab, torch.float32))
    raw = warm_up_logits(cpu, vocab, torch.bfloat16)
    expected = torch.log_softmax(raw.float(), dim=-1).max(dim=-1).values
    torch.testing.assert_close(results["logprobs"], expected, rtol=0, atol=1e-5)
    masked, narrow = results["masked_logits"], vocab - 32  # the mask is one word short: its last 32 ids disallowed
    assert torch.equal(masked[0], raw[0]) and torch.equal(masked[1, :narrow], raw[1, :narrow])
    assert torch.isneginf(masked[1, narrow:]).all()


def compiled_variants(kernel) -> int:
    """How many variants of a Triton kernel this process compiled (its per-device caches)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.gpu
def test_gpu_warm_up_leaves_nothing_to_compile_for_a_step():
    """After warm_up_sampling, what a step's sampling runs (other batch sizes, both logits dtypes, the logit
    controls with other entry counts, the history update, logprobs) compiles nothing more."""
    from nanovllm.kernels import logit_controls as control_kernels
    from nanovllm.kernels import logprobs, penalties, sampling

    device, vocab = torch.device("cuda"), 151936
    warm_up_sampling(device, vocab, torch.bfloat16)
    kernels = [sampling._sample_kernel, sampling._sample_wide_kernel,
               logprobs._segment_kernel, logprobs._combine_kernel, penalties._penalties_kernel,
               control_kernels._record_kernel, control_kernels._batch_index_kernel,
               control_kernels._bad_words_kernel, control_kernels._min_tokens_kernel, control_kernels._bias_kernel]
    before = [compiled_variants(kernel) for kernel in kernels]
    assert all(before), before
    rows = 37
    settings = SamplingTensors(
        temperatures=torch.rand(rows, device=device), top_k=torch.randint(1, 2000, (rows,), device=device),
        top_p=torch.rand(rows, device=device) * 0.5 + 0.5, min_p=torch.rand(rows, device=device) * 0.1,
        seeds=torch.arange(rows, device=device), sample_positions=torch.arange(rows, device=device),
        all_greedy=False, any_filter=True)
    for dtype in (torch.bfloat16, torch.float32):
        sample(torch.randn(rows, vocab, device=device).to(dtype), settings)
    history = logit_controls.TokenHistory.allocate(8, vocab, logit_controls.HISTORY_WINDOW, device)
    history.reset(3, list(range(100)), [5, 6])
    logits = torch.randn(6, vocab, device=device)

    def ids(*values):
        return torch.tensor(values, device=device)

    index = logit_controls.batch_index_of(ids(7, 2, 5, 0, 1, 3), 12)
    allowing = torch.zeros(12, dtype=torch.bool, device=device)
    allowing[[2, 9]] = True
    bitmask = torch.from_numpy(np.stack([logit_controls.allowed_bitmask([1, 2, 3] if row != 9 else [4, 5], vocab)
                                         for row in range(12)])).to(device)
    logit_controls.apply_allowed_tokens(logits, index, allowing, bitmask)
    prefixes, banned = logit_controls.pack_bad_words([[5, 6, 7], [9], [8]], logit_controls.HISTORY_WINDOW)
    logit_controls.apply_bad_words(logits, index, ids(5, 5, 11), ids(3, 3, 3), prefixes.to(device), banned.to(device),
                                   history)
    # entry counts of every specialization class Triton has for integers: 1 (a constant), multiples of 16, others
    for count in (1, 3, 16):
        rows_of = ids(*[7] * count)
        logit_controls.apply_min_tokens(logits, index, rows_of, ids(*range(2, 2 + count)), ids(*[4] * count),
                                        ids(*range(6)))
        logit_controls.apply_logit_bias(logits, index, rows_of, ids(*range(10, 10 + count)), ids(*[1.0] * count))
    logit_controls.apply_penalties(logits, ids(2), ids(3), history, *(torch.ones(1, device=device),) * 3)
    history.record(ids(3, 4), logits.argmax(dim=-1), ids(2, 0))
    raw = torch.randn(5, vocab, device=device, dtype=torch.bfloat16)
    tokens = raw.argmax(dim=-1)
    from nanovllm.layers.logprobs import compute_logprobs
    for rows_asking in (1, 2, 4):  # the partials' sizes, whose pointers' alignment once followed the row count
        for num_top in (0, 1, 2):
            compute_logprobs(raw[:rows_asking], tokens[1:1 + rows_asking], num_top)  # token ids at an odd offset
    torch.cuda.synchronize()
    assert [compiled_variants(kernel) for kernel in kernels] == before
