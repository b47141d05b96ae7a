"""Shared builders for engine tests."""
from __future__ import annotations

import itertools

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(token_ids: list[int], max_tokens: int = 16, **params) -> Sequence:
    seq_id = next(_ids)
    return Sequence(seq_id, str(seq_id), token_ids, SamplingParams(max_tokens=max_tokens, **params), sampling_seed=0)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def model_prompt_logits(model, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits of every prompt position from a loaded model of ours (torch attention backend over a paged cache),
    the prompt fed in chunks of `chunk` tokens so later chunks read earlier ones from the cache."""
    from nanovllm.attention import AttentionMetadata
    from nanovllm.attention.torch_backend import TorchAttentionBackend

    block_size, num_tokens = 16, len(prompt)
    num_blocks = -(-num_tokens // block_size)
    for layer in model.attention_layers():
        layer.k_cache = torch.zeros(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.v_cache = torch.zeros_like(layer.k_cache)
        layer.backend = TorchAttentionBackend()
    table = torch.arange(num_blocks, dtype=torch.int32).flip(0)[None]  # blocks out of order
    logits = []
    with torch.inference_mode():
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            positions = torch.arange(start, end)
            meta = AttentionMetadata(
                slot_mapping=(table[0, positions // block_size] * block_size + positions % block_size).long(),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table, max_query_len=end - start,
                max_seq_len=end)
            logits.append(model.compute_logits(model(torch.tensor(prompt[start:end]), positions, meta)))
    return torch.cat(logits)


class GraphSizes:
    """Stands in for the CUDA decode graphs on the CPU: the runner pads a decode batch of 3 to graph size 4."""

    @staticmethod
    def batch_size_for(num_seqs: int) -> int:
        return 4

    @staticmethod
    def release() -> None:
        """Nothing was captured."""
