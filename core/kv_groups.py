"""How the KV cache's layers share blocks, so that windowed layers hold only their window (docs/ARCHITECTURE.md).

One pool of blocks serves every layer. A block has `width` layer slots, filled by the layers of one group; a
group's layers share one window rule and, per sequence, one block table. A model whose layers all attend alike
(all global, or all with one sliding window) has one group as wide as the model: a block holds every layer. A
model that interleaves windowed and global layers (Gemma 2/3) gets several groups of equal width, so that any
group can take any free block: a global group keeps the whole context, while a windowed group hands back the
blocks that fell behind its window as the sequence advances (its memory stays bounded by the window).

A sequence's groups have tables of one length (its logical blocks), kept interleaved in one flat list: entry
`i * num_groups + g` is group g's block for positions [i * block_size, (i + 1) * block_size). The list only grows
at its end, as with one group. A windowed group's entries behind its window are `NO_BLOCK`: attention never
reads positions outside a layer's window (kernels/paged_tile.py), and nothing writes there."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NO_BLOCK = -1
_MAX_PADDING = 0.10  # share of a block's layer slots a grouping may leave empty


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, None for global attention
    width: int  # layer slots per block
    layer_slots: tuple[tuple[int, int], ...]  # per attention layer: (its group, its slot in the group's blocks)

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def max_blocks_held(windows: Sequence[int | None], num_tokens: int, block_size: int, max_chunk: int) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once over groups of these `windows`, computed
    in chunks of at most `max_chunk` tokens: a windowed group holds the blocks its window reaches behind a chunk,
    and the chunk's."""
    full = -(-num_tokens // block_size)
    return sum(full if window is None else min(full, -(-(window - 1 + max_chunk) // block_size) + 1)
               for window in windows)


def plan_kv_groups(layer_windows: Sequence[int | None]) -> KVGroups:
    """Group layers by window: one group when all layers attend alike; otherwise the widest equal width that
    leaves at most 10 % of the slots empty (fewer groups: fewer tables per sequence). A model without attention
    layers (an encoder, which keeps no KV) has one empty group."""
    if not layer_windows:
        return KVGroups((None,), 0, ())
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    sizes = [len(layers) for layers in kinds.values()]
    width = len(layer_windows) if len(kinds) == 1 else max(
        w for w in range(1, min(sizes) + 1)
        if sum(-(-n // w) * w for n in sizes) - len(layer_windows) <= _MAX_PADDING * len(layer_windows))
    windows: list[int | None] = []
    slots: dict[int, tuple[int, int]] = {}
    for window, layers in kinds.items():
        for start in range(0, len(layers), width):
            for slot, layer in enumerate(layers[start:start + width]):
                slots[layer] = (len(windows), slot)
            windows.append(window)
    return KVGroups(tuple(windows), width, tuple(slots[layer] for layer in range(len(layer_windows))))
