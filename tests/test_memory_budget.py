"""The KV cache's share of GPU memory (nanovllm.runner.memory_budget), against hand-computed figures."""
from nanovllm.runner.memory_budget import (
    AFTER_CACHE_HEADROOM,
    PROCESS_ALLOWANCE,
    DeviceMemory,
    kv_cache_bytes,
    tensor_bytes,
)

GB = 10**9


def test_the_share_is_utilization_of_the_device_less_what_the_engine_holds():
    memory = DeviceMemory(total=80 * GB, free=70 * GB, engine_bytes=10 * GB, peak_activations=2 * GB)
    assert kv_cache_bytes(memory, 0.5) == 40 * GB - 10 * GB - 2 * GB - PROCESS_ALLOWANCE


def test_memory_held_by_others_does_not_shrink_the_share_while_it_is_free():
    """Two engines at 0.45 on one GPU: the second sees the first's 36 GB in use and gets the same cache."""
    alone = DeviceMemory(total=80 * GB, free=78 * GB, engine_bytes=2 * GB, peak_activations=1 * GB)
    beside_another = DeviceMemory(total=80 * GB, free=42 * GB, engine_bytes=2 * GB, peak_activations=1 * GB)
    assert kv_cache_bytes(alone, 0.45) == kv_cache_bytes(beside_another, 0.45) == 36 * GB - 3 * GB - PROCESS_ALLOWANCE


def test_the_cache_never_takes_more_than_is_free():
    memory = DeviceMemory(total=80 * GB, free=5 * GB, engine_bytes=1 * GB, peak_activations=2 * GB)
    assert kv_cache_bytes(memory, 0.9) == 5 * GB - 2 * GB - AFTER_CACHE_HEADROOM
    assert kv_cache_bytes(DeviceMemory(80 * GB, GB // 4, GB, GB), 0.9) == 0


def test_tensor_bytes_counts_a_tied_weight_once():
    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    model[1].weight = model[0].weight
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    assert tensor_bytes(model) == 10 * 4 * 4 + 10 * 4 + 3 * 8
