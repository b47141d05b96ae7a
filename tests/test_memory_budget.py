"""The KV cache's share of GPU memory (nanovllm.runner.memory_budget), against hand-computed figures."""
from nanovllm.runner.memory_budget import (
    AFTER_CACHE_HEADROOM,
    MAX_AUTO_NUM_SEQS,
    MIN_AUTO_NUM_SEQS,
    PROCESS_ALLOWANCE,
    DeviceMemory,
    WorstStep,
    auto_max_num_seqs,
    kv_cache_bytes,
    tensor_bytes,
)

GB = 10**9


def test_the_share_is_utilization_of_the_device_less_what_the_engine_holds():
    memory = DeviceMemory(total=80 * GB, free=70 * GB, engine_bytes=10 * GB, worst_step=WorstStep(2 * GB))
    assert kv_cache_bytes(memory, 0.5) == 40 * GB - 10 * GB - 2 * GB - PROCESS_ALLOWANCE


def test_memory_held_by_others_does_not_shrink_the_share_while_it_is_free():
    """Two engines at 0.45 on one GPU: the second sees the first's 36 GB in use and gets the same cache."""
    alone = DeviceMemory(total=80 * GB, free=78 * GB, engine_bytes=2 * GB, worst_step=WorstStep(1 * GB))
    beside_another = DeviceMemory(total=80 * GB, free=42 * GB, engine_bytes=2 * GB, worst_step=WorstStep(1 * GB))
    assert kv_cache_bytes(alone, 0.45) == kv_cache_bytes(beside_another, 0.45) == 36 * GB - 3 * GB - PROCESS_ALLOWANCE


def test_the_cache_never_takes_more_than_is_free():
    memory = DeviceMemory(total=80 * GB, free=5 * GB, engine_bytes=1 * GB, worst_step=WorstStep(2 * GB))
    assert kv_cache_bytes(memory, 0.9) == 5 * GB - 2 * GB - AFTER_CACHE_HEADROOM
    assert kv_cache_bytes(DeviceMemory(80 * GB, GB // 4, GB, WorstStep(GB)), 0.9) == 0


def test_tensor_bytes_counts_a_tied_weight_once():
    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    model[1].weight = model[0].weight
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    assert tensor_bytes(model) == 10 * 4 * 4 + 10 * 4 + 3 * 8


def test_the_worst_step_is_reserved_before_the_cache_takes_the_rest():
    """An 80 GB device at 0.9, 16 GB of weights, a worst step of 3 GB of transient activations (a full token
    budget, 1,024 rows of logits sampled with logprobs) and 1.5 GB kept by the largest decode graph. With the
    reservation, the step at its peak fits the share; a plan that measured only a prefill forward of a few rows
    (0.5 GB, no graph pool) would give the cache memory that the worst step then needs: out of memory mid-job."""
    total, weights = 80 * GB, 16 * GB
    worst = WorstStep(activations=3 * GB, graph_pool=GB * 3 // 2)

    def peak_in_a_job(cache: int) -> int:  # weights, cache, graphs captured after it, the step, the process
        return weights + cache + worst.graph_pool + worst.activations + PROCESS_ALLOWANCE

    planned = kv_cache_bytes(DeviceMemory(total, total - weights, weights, worst), 0.9)
    assert planned > 0 and peak_in_a_job(planned) <= 0.9 * total
    naive = kv_cache_bytes(DeviceMemory(total, total - weights, weights, WorstStep(GB // 2)), 0.9)
    assert peak_in_a_job(naive) > 0.9 * total


def test_the_default_batch_grows_with_the_cache_between_the_bounds():
    assert auto_max_num_seqs(1000) == MIN_AUTO_NUM_SEQS  # a small cache: today's default
    assert auto_max_num_seqs(400_000) == 768  # e.g. Qwen3-8B's bf16 cache on an 80 GB GPU: 781 rows of 512
    assert auto_max_num_seqs(10**9) == MAX_AUTO_NUM_SEQS  # the peers' largest default
    assert all(auto_max_num_seqs(n) % 64 == 0 for n in range(0, 2_000_000, 9_973))
