"""What the KV / prefix cache will do with a set of tokenized prompts, without running a model.

The prompts are replayed through the engine's own block manager (`PrefixCacheReplay`) one row at a time,
once in file order and once in the prefix-aware order `run` admits by default. Output tokens are not
modelled (their lengths are unknown before the run), so the hit figures are those of the prompts alone,
for a cache of `num_blocks` blocks with one row in it at a time.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from nanovllm import PrefixCacheReplay, block_hashes
from nanovllm_cli.admission import admission_groups
from nanovllm_cli.rows import RowRequest


@dataclass
class PrefixNode:
    """A full block, identified by its chained hash (so by its whole prefix)."""

    parent: int | None
    depth: int  # 1: the first block of a prompt
    rows: int = 1  # rows whose prompt starts with this prefix
    token_ids: list[int] | None = None  # the block's tokens, kept once a second row shares it


class PrefixTree:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.nodes: dict[int, PrefixNode] = {}

    def add(self, token_ids: list[int], hashes: list[int]) -> None:
        parent = None
        for depth, h in enumerate(hashes, 1):
            node = self.nodes.get(h)
            if node is None:
                self.nodes[h] = PrefixNode(parent, depth)
            else:
                node.rows += 1
                if node.token_ids is None:
                    node.token_ids = token_ids[(depth - 1) * self.block_size:depth * self.block_size]
            parent = h

    def most_shared(self, top: int) -> list[tuple[list[int], int]]:
        """(prefix token ids, rows) of the shared prefixes that save the most tokens, longest form only."""
        widest_child: Counter[int] = Counter()
        for node in self.nodes.values():
            if node.parent is not None and node.rows >= 2:
                widest_child[node.parent] = max(widest_child[node.parent], node.rows)
        maximal = [(h, n) for h, n in self.nodes.items() if n.rows >= 2 and widest_child[h] < n.rows]
        maximal.sort(key=lambda hn: ((hn[1].rows - 1) * hn[1].depth, hn[1].rows), reverse=True)
        return [(self._prefix(h), node.rows) for h, node in maximal[:top]]

    def _prefix(self, h: int | None) -> list[int]:
        blocks = []
        while h is not None:
            blocks.append(self.nodes[h].token_ids)
            h = self.nodes[h].parent
        return [t for block in reversed(blocks) for t in block]


def histogram(lengths: Counter[int]) -> list[dict]:
    """Rows per prompt-length bucket: 1-16, 17-32, 33-64, ... from the first non-empty bucket to the last."""
    buckets = []
    low, high = 1, 16
    longest = max(lengths, default=0)
    while low <= longest:
        rows = sum(count for n, count in lengths.items() if low <= n <= high)
        if rows or buckets:
            buckets.append({"min_tokens": low, "max_tokens": high, "rows": rows})
        low, high = high + 1, high * 2
    return buckets


class CacheAnalysis:
    """Accumulates the rows of a file; `report` gives the figures."""

    def __init__(self, block_size: int, num_blocks: int, window: int, kv_windows: tuple[int | None, ...]):
        self.block_size = block_size
        self.window = window  # run's read-ahead window: the span prefix-aware ordering sorts
        self.prompt_lengths: Counter[int] = Counter()
        self.blocks_needed = 0
        self.partial_blocks = 0
        self.tree = PrefixTree(block_size)
        self.file_order = PrefixCacheReplay(num_blocks, block_size, kv_windows)
        self.prefix_aware = PrefixCacheReplay(num_blocks, block_size, kv_windows)
        self.pending: list[RowRequest] = []

    def add(self, request: RowRequest) -> None:
        ids = request.token_ids
        self.prompt_lengths[len(ids)] += 1
        self.blocks_needed += -(-len(ids) // self.block_size)
        self.partial_blocks += len(ids) % self.block_size != 0
        self.tree.add(ids, block_hashes(ids, self.block_size))
        self.file_order.add(ids)
        self.pending.append(request)
        if len(self.pending) == self.window:
            self._flush_window()

    def _flush_window(self) -> None:
        for group in admission_groups(self.pending, True, self.block_size):
            for request in group.requests:
                self.prefix_aware.add(request.token_ids)
        self.pending = []

    def report(self, top: int) -> dict:
        """Figures over the rows added; `top_prefixes` lists token ids (the caller may decode them)."""
        self._flush_window()
        unique = len(self.tree.nodes) + self.partial_blocks
        lengths = self.prompt_lengths
        rows = sum(lengths.values())
        prompt_tokens = sum(n * c for n, c in lengths.items())
        return {
            "prompt_tokens": prompt_tokens,
            "prompt_tokens_min": min(lengths, default=0),
            "prompt_tokens_mean": prompt_tokens / rows if rows else 0.0,
            "prompt_tokens_max": max(lengths, default=0),
            "blocks_needed": self.blocks_needed,
            "unique_blocks": unique,
            "shared_blocks": self.blocks_needed - unique,
            "file_order": self.file_order.report(),
            "prefix_aware": self.prefix_aware.report(),
            "top_prefixes": [{"tokens": len(ids), "rows": n, "token_ids": ids} for ids, n in self.tree.most_shared(top)],
            "histogram": histogram(lengths),
        }
