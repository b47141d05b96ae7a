"""A step's inputs in a form that reaches the other tensor-parallel ranks cheaply (docs/ARCHITECTURE.md).

`pack` flattens a (nested) dataclass such as StepInputs into a short header of ints — per field a tag, then a
tensor's dtype and shape or a scalar's value — and one byte payload that holds every tensor's bytes (8-aligned),
built by one concatenation on the device the tensors live on. Rank 0 sends the header through each worker's pipe
and broadcasts the payload over the group (device to device under NCCL, so input ids that the step in flight
samples never visit the host); `unpack` rebuilds the same dataclass around views of the received payload, without
a copy. No sequence is ever pickled."""
from __future__ import annotations

import dataclasses
import functools
import typing

import torch

_TENSOR, _INT, _BOOL, _NONE = range(4)
_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
           torch.float64, torch.float32, torch.float16, torch.bfloat16)
_ALIGN = 8  # every tensor starts at a multiple of the widest element size
_padding: dict[torch.device, torch.Tensor] = {}  # zero bytes to align the next tensor, per device


def pack(obj) -> tuple[list[int], torch.Tensor]:
    """(header, uint8 payload) of a dataclass whose fields are tensors, ints, bools, None or such dataclasses."""
    header: list[int] = []
    parts: list[torch.Tensor] = []
    _pack(obj, header, parts)
    return header, torch.cat(parts)


def _pack(obj, header: list[int], parts: list[torch.Tensor]) -> None:
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            _pack(value, header, parts)
        elif isinstance(value, torch.Tensor):
            header += [_TENSOR, _DTYPES.index(value.dtype), value.dim(), *value.shape]
            data = value.contiguous().reshape(-1).view(torch.uint8)
            parts.append(data)
            pad = -len(data) % _ALIGN
            if pad:
                if value.device not in _padding:
                    _padding[value.device] = torch.zeros(_ALIGN, dtype=torch.uint8, device=value.device)
                parts.append(_padding[value.device][:pad])
        elif isinstance(value, bool):
            header += [_BOOL, int(value)]
        elif isinstance(value, int):
            header += [_INT, value]
        elif value is None:
            header.append(_NONE)
        else:
            raise TypeError(f"{type(obj).__name__}.{field.name}: a {type(value).__name__} cannot be sent to the "
                            "tensor-parallel workers (tensors, ints, bools, None and dataclasses of them can)")


def unpack(cls: type, header: list[int], payload: torch.Tensor):
    """The `cls` instance that `pack` turned into (header, payload); its tensors are built from `payload`."""
    obj, _, _ = _unpack(cls, header, 0, payload, 0)
    return obj


def _unpack(cls: type, header: list[int], at: int, payload: torch.Tensor, offset: int) -> tuple[object, int, int]:
    values = {}
    for name, hint in _field_types(cls):
        if dataclasses.is_dataclass(hint):
            values[name], at, offset = _unpack(hint, header, at, payload, offset)
            continue
        tag = header[at]
        if tag == _TENSOR:
            dtype, ndim = _DTYPES[header[at + 1]], header[at + 2]
            shape = header[at + 3:at + 3 + ndim]
            nbytes = dtype.itemsize
            for size in shape:
                nbytes *= size
            values[name] = payload[offset:offset + nbytes].view(dtype).view(shape)
            at, offset = at + 3 + ndim, offset + nbytes + (-nbytes % _ALIGN)
        elif tag == _NONE:
            values[name], at = None, at + 1
        else:
            values[name], at = (bool(header[at + 1]) if tag == _BOOL else header[at + 1]), at + 2
    return cls(**values), at, offset


@functools.cache
def _field_types(cls: type) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    return [(field.name, hints[field.name]) for field in dataclasses.fields(cls)]

