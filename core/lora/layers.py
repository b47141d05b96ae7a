"""Adapters on nanovllm's linear layers: each column- or row-parallel projection of a model gets the device slots
of its adapters (A [slots, slices, R, in], B [slots, out, R] with the adapter's scale folded in, R =
max_lora_rank, and a rank per slot and slice), and adds, after its own product, each token's update from the
slot the step gives that token (-1: none). On CUDA the update is kernels/lora.py's: its dense products where the
pool is small next to the projection (with every A stored under a plain base weight, so that the base product
makes the first of them), else its two grouped launches for the whole batch; elsewhere
`add_lora_torch`, the same sum as plain torch ops slot by slot (the CPU path and the reference of both).

A packed projection (q|k|v, gate|up) has one slice per part, each with its own A and its own columns of the
output. An adapter module that covers the packed layer whole (Phi-3 checkpoints adapt `qkv_proj` as one) has one
A for every part: it is written into each slice, and its B cut into the parts.

Tensor parallelism follows the layer's own split, through the layer's `weight_loader` (the rule that slices the
base weight): a column-parallel layer keeps the whole A and this rank's rows of B (the heads of q, k and v, the
rows of gate and up); a row-parallel one keeps this rank's columns of A and the whole B, and its update is added
to the partial product before the all-reduce, which sums the ranks' partial updates with it."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.distributed import all_reduce
from nanovllm.kernels.lora_dense import DENSE_MAX_EXTRA, add_dense_expand, dense_extra_flops, off_slot_mask
from nanovllm.layers.fp8 import Fp8Activation
from nanovllm.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from nanovllm.loaders.weights import checkpoint_target, load_whole
from nanovllm.lora.adapter import LoRAAdapter, LoRAModule


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   slice_starts: list[int], token_slots: torch.Tensor) -> torch.Tensor:
    """kernels/lora.py `add_lora` as torch ops, slot by slot over the whole padded rank (the padding is zero),
    in float32: y [tokens, out] += (x @ A[slot, i]^T) @ B[slot, columns of slice i]^T for each
    token of a slot >= 0 and each slice i. In place; returns y."""
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        xs = x[rows].float()
        for i, (start, end) in enumerate(zip(slice_starts[:-1], slice_starts[1:])):
            update = (xs @ lora_a[slot, i].float().T) @ lora_b[slot, start:end].float().T
            y[rows, start:end] = (y[rows, start:end].float() + update).to(y.dtype)
    return y


# How a layer adds its update: the torch loop (add_lora_torch), the grouped Triton kernels, the dense products.
UPDATES = ("torch", "triton", "dense")


class StepSlots:
    """The adapter slot of each token of the current step, shared by every LoRA layer of a model (None: no token
    of the step has an adapter, and the layers run as the base model). Computed once per step for every layer:
    `batch`, its sorted layout for the grouped kernels; `off_slot`, [tokens, slots] bool (True where a token does
    not use the slot) for the dense update."""

    def __init__(self):
        self.token_slots: torch.Tensor | None = None
        self.batch = None
        self.off_slot: torch.Tensor | None = None


def _stack_under(param: nn.Parameter, rows: int) -> torch.Tensor:
    """A new tensor holding `param` with `rows` zero rows under it; `param` becomes a view of its top (its
    loaders and every reader see the same values)."""
    stacked = torch.zeros(param.shape[0] + rows, *param.shape[1:], dtype=param.dtype, device=param.device)
    stacked[:param.shape[0]].copy_(param.data)
    param.data = stacked[:param.shape[0]]
    return stacked


class LoRALinear(nn.Module):
    """A column- or row-parallel linear layer of nanovllm (`base`) with adapter slots (module docstring).
    `update`: one of UPDATES; None chooses (on CUDA dense where kernels/lora_dense.py says it pays, else triton; on
    other devices torch)."""

    def __init__(self, base: LinearBase, max_loras: int, max_lora_rank: int, dtype: torch.dtype, step: StepSlots,
                 update: str | None = None):
        super().__init__()
        assert isinstance(base, (ColumnParallelLinear, RowParallelLinear))
        self.base = base
        self.step = step
        self.row_parallel = isinstance(base, RowParallelLinear)
        out_features, in_features = base.weight.shape
        full_out = base.weight.full_shape[0]
        # part id -> full rows; one slice holding every column for an unpacked layer
        self.parts: dict = getattr(base.weight, "packed_parts", None) or {None: full_out}
        widths = [rows * out_features // full_out for rows in self.parts.values()]
        assert sum(widths) == out_features
        starts = [0]
        for width in widths:
            starts.append(starts[-1] + width)
        self.slice_starts = starts
        self.max_slice_width = max(widths)
        device = base.weight.device
        slices = len(widths)
        plain = base.fp8 is None and base.weight.dtype == dtype  # what the dense update stacks A under
        if update is None:
            dense = plain and (dense_extra_flops(max_loras, slices, max_lora_rank, in_features, out_features)
                               <= DENSE_MAX_EXTRA)
            update = ("dense" if dense else "triton") if device.type == "cuda" else "torch"
        assert update in UPDATES, update
        assert update != "dense" or plain, "the dense update stacks A under a plain weight of the pool's dtype"
        self.update = update
        # Stored slot-second (the dense products read each slice's A and the whole B as one matrix); `lora_a` and
        # `lora_b` are their slot-first views, which every path indexes.
        a_shape = (slices, max_loras, max_lora_rank, in_features)
        # On the dense path every A is stored under the base weight, in one matrix: the base product then makes
        # the update's first product too (its extra columns), in the same launch.
        self.weight_and_a = self.bias_and_zeros = None
        if update == "dense":
            self.weight_and_a = _stack_under(base.weight, slices * max_loras * max_lora_rank)
            a_storage = self.weight_and_a[out_features:].view(a_shape)
            if base.bias is not None and not self.row_parallel:
                self.bias_and_zeros = _stack_under(base.bias, slices * max_loras * max_lora_rank)
        else:
            a_storage = torch.zeros(a_shape, dtype=dtype, device=device)
        self.register_buffer("lora_a_storage", a_storage, persistent=False)
        self.register_buffer("lora_b_storage", torch.zeros(out_features, max_loras, max_lora_rank, dtype=dtype,
                                                           device=device), persistent=False)
        self.register_buffer("ranks", torch.zeros(max_loras, slices, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("slice_starts_device", torch.tensor(starts, dtype=torch.int32, device=device),
                             persistent=False)

    @property
    def lora_a(self) -> torch.Tensor:
        """[slots, slices, R, in]"""
        return self.lora_a_storage.transpose(0, 1)

    @property
    def lora_b(self) -> torch.Tensor:
        """[slots, out, R]"""
        return self.lora_b_storage.transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step.token_slots is None:
            return self.base(x)
        if isinstance(x, Fp8Activation):
            raise ValueError("a LoRA layer got FP8-quantized activations: adapters need the unquantized input, so "
                             "the activation quantization must not be fused into the layer before it")
        base = self.base
        if not self.row_parallel:
            return self.product_and_update(x, base.bias)
        # RowParallelLinear.forward with the update added to this rank's partial product before the reduction
        y = self.product_and_update(x, None)
        if base.reduce:
            y = all_reduce(y.contiguous())
        return y + base.bias if base.bias is not None else y

    def product_and_update(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The base product of x (+ bias) with each token's adapter update added. With A stacked under the
        weight, a view of the stacked product: rows wider than the output (every kernel downstream takes a row
        stride)."""
        if self.weight_and_a is None:
            return self.add_update(x, self.base.matmul(x, bias))
        assert self.base.weight.data_ptr() == self.weight_and_a.data_ptr(), \
            "a LoRA layer's weight was moved or replaced after the adapters' A were stacked under it"
        width = self.slice_starts[-1]
        stacked = self.base.matmul(x, None if bias is None else self.bias_and_zeros, self.weight_and_a)
        return add_dense_expand(stacked[:, :width], stacked[:, width:], self.lora_b, self.slice_starts,
                                self.step.off_slot)

    def add_update(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y += each token's adapter update of x, in place (the grouped kernels or the torch loop; the dense
        update is part of `product_and_update`)."""
        if self.update == "triton":
            from nanovllm.kernels.lora import add_lora

            return add_lora(y, x, self.lora_a, self.lora_b, self.ranks, self.slice_starts_device,
                            self.max_slice_width, self.step.batch)
        return add_lora_torch(y, x, self.lora_a, self.lora_b, self.slice_starts, self.step.token_slots)

    @torch.no_grad()
    def write_slot(self, slot: int, modules: dict, describe: str) -> None:
        """Fill `slot` with one adapter's modules of this layer: part id (None: the whole layer) -> LoRAModule;
        slices it does not adapt get rank 0. `describe` names the adapter in errors."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.ranks[slot].zero_()
        part_ids = list(self.parts)
        for part, module in modules.items():
            self._check_shapes(part, module, describe)
            slices = range(len(part_ids)) if part is None else [part_ids.index(part)]
            rank = module.rank
            for i in slices:
                a = self.lora_a[slot, i, :rank]
                a.full_shape = (rank, self.base.weight.full_shape[1])
                LinearBase.weight_loader(self.base, a, module.lora_a)  # row-parallel: this rank's columns
                self.ranks[slot, i] = rank
            b = self.lora_b[slot, :, :rank]
            b.full_shape = (self.base.weight.full_shape[0], rank)
            scaled_b = module.lora_b.float() * module.scale  # rounded once, into the pool's type
            if part is None:
                b.packed_parts = getattr(self.base.weight, "packed_parts", None)
                load_whole(b, self.base.weight_loader, scaled_b)  # a packed layer's B is cut into its parts
            else:
                self.base.weight_loader(b, scaled_b, part)  # this rank's rows of the part

    def _check_shapes(self, part, module: LoRAModule, describe: str) -> None:
        rows = self.parts[part] if part in self.parts else sum(self.parts.values())
        expected_a = (module.rank, self.base.weight.full_shape[1])
        if tuple(module.lora_a.shape) != expected_a or tuple(module.lora_b.shape) != (rows, module.rank):
            raise ValueError(f"{describe}: lora_A {tuple(module.lora_a.shape)} and lora_B {tuple(module.lora_b.shape)} "
                             f"do not fit this model's layer (expected {expected_a} and {(rows, module.rank)}): the "
                             "adapter was trained for another base model")


class LoRALayers:
    """Every column- and row-parallel linear layer of `model` made a `LoRALinear` (in place, after the model's
    weights are loaded: the wrappers move the layers' parameters under `.base`), the step's token slots they
    share, and the writing of an adapter into a slot.

    `update`: how every layer adds its update (`LoRALinear`'s; None: each layer chooses)."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 update: str | None = None):
        self.model = model
        self.max_loras = max_loras
        self.step = StepSlots()
        self.layers: dict[str, LoRALinear] = {}
        for name, module in list(model.named_modules()):
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                wrapped = LoRALinear(module, max_loras, max_lora_rank, dtype, self.step, update)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, wrapped)
                self.layers[name] = wrapped
        self.updates = {layer.update for layer in self.layers.values()}
        self.slot_ids = torch.arange(max_loras, dtype=torch.int32,
                                     device=next(iter(self.layers.values())).base.weight.device if self.layers else None)

    def set_step(self, token_slots: torch.Tensor | None) -> None:
        """The slot of each token of the next forward (-1: the base model), on the model's device; None when no
        token has an adapter. This sorts the tokens by slot for the grouped kernels and makes the dense update's
        slot mask (device work, no host sync): call it inside a captured decode graph, before the model."""
        self.step.token_slots = token_slots
        self.step.batch = self.step.off_slot = None
        if token_slots is None:
            return
        if "triton" in self.updates:
            from nanovllm.kernels.lora import sort_tokens_by_slot

            self.step.batch = sort_tokens_by_slot(token_slots, self.max_loras)
        if "dense" in self.updates:
            self.step.off_slot = off_slot_mask(token_slots, self.slot_ids)

    def check(self, adapter: LoRAAdapter) -> None:
        """Raise the ValueError `load` would (a module the model has no layer for, or matrices that do not fit
        it), without writing anything."""
        for name, parts in self._targets(adapter).items():
            layer = self.layers[name]
            for part, module in parts.items():
                layer._check_shapes(part, module, f"LoRA adapter {adapter.name!r}, layer {name}")

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write `adapter` into `slot` of every layer (the layers it does not adapt get rank 0 there). On the
        device the writes are ordered on the current stream: after steps already launched that read the slot."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside the {self.max_loras} adapter slots")
        targets = self._targets(adapter)
        for name, layer in self.layers.items():
            layer.write_slot(slot, targets.get(name, {}), f"LoRA adapter {adapter.name!r}, layer {name}")

    def _targets(self, adapter: LoRAAdapter) -> dict[str, dict]:
        """The adapter's modules by our layer name, then part id (None: the whole layer)."""
        targets: dict[str, dict] = {}
        for hf_name, module in adapter.modules.items():
            target, part = checkpoint_target(self.model, f"{hf_name}.weight")
            name = target.removesuffix(".weight")
            if name not in self.layers or isinstance(part, tuple):
                trained_for = f" (it was trained for {adapter.base_model})" if adapter.base_model else ""
                raise ValueError(f"LoRA adapter {adapter.name!r} adapts {hf_name}, which this model has no linear "
                                 f"layer for: the adapter was made for another base model{trained_for}")
            parts = targets.setdefault(name, {})
            if part in parts or (None in parts) or (part is None and parts):
                raise ValueError(f"LoRA adapter {adapter.name!r} adapts {hf_name} twice (as a packed layer and as "
                                 "its parts)")
            parts[part] = module
        return targets


class StepSlotsModel:
    """`model` with the step's adapter slots set inside its forward, from the first tokens of `token_slots` (a
    fixed device buffer): what a CUDA graph of a step with adapters captures, so that the tokens' sort and the
    LoRA kernels are replayed with the model (cuda_graphs.py calls `model(...)` and `model.compute_logits`)."""

    def __init__(self, model: nn.Module, lora: LoRALayers, token_slots: torch.Tensor):
        self.model, self.lora, self.token_slots = model, lora, token_slots

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        self.lora.set_step(self.token_slots[:len(input_ids)])
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
