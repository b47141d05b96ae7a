"""A model's files checked whole before anything is loaded from them, so that a truncated download or copy is one
error naming the file (not a traceback from deep inside a loader, after workers and memory were set up): every
JSON file of the checkpoint parses, every safetensors file holds all the bytes its header declares, and a GGUF
file holds all its tensors' data. Headers only: the checks read kilobytes, not the weights."""
from __future__ import annotations

import json
import struct
from pathlib import Path

_JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "special_tokens_map.json", "model.safetensors.index.json")
_AGAIN = "download or copy it again"


def check_checkpoint_files(directory: Path, weights: bool) -> None:
    """The files of an HF checkpoint directory (`weights`: its safetensors too); ValueError naming a bad one."""
    for name in _JSON_FILES:
        path = directory / name
        if path.exists():
            try:
                with open(path, "rb") as f:
                    json.load(f)
            except OSError as exc:
                raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
            except ValueError as exc:
                raise ValueError(f"{path} is not complete JSON ({exc}): {_AGAIN}") from None
    if not weights:
        return
    for path in weight_files(directory):
        check_safetensors(path)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files a checkpoint's weights are in, chosen as transformers does: a whole
    `model.safetensors` (savers that rewrite a sharded checkpoint whole, sentence-transformers, leave the old index
    and shards behind), else the shards its index names, else every `*.safetensors` file. ValueError naming a shard
    the index names that is not there."""
    whole = directory / "model.safetensors"
    if whole.exists():
        return [whole]
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return sorted(directory.glob("*.safetensors"))
    shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    missing = [name for name in shards if not (directory / name).exists()]
    if missing:
        raise ValueError(f"{index} names shards that are not in {directory}: {', '.join(missing[:5])}")
    return [directory / name for name in shards]


def check_safetensors(path: Path) -> None:
    """The file's header parses and its tensors' bytes all lie inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            header_bytes = int.from_bytes(head, "little") if len(head) == 8 else None
            if header_bytes is None or 8 + header_bytes > size:
                raise ValueError(f"{path} is truncated: {size:,} bytes, shorter than its own header; {_AGAIN}")
            header = json.loads(f.read(header_bytes))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON): {_AGAIN}") from None
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        raise ValueError(f"{path} is not a safetensors file (its header lists no tensor offsets)") from None
    if 8 + header_bytes + end > size:
        raise ValueError(f"{path} is truncated: its tensors need {8 + header_bytes + end:,} bytes and the file has "
                         f"{size:,}; {_AGAIN}")


class _GgufReader:
    """Little-endian GGUF header fields, read in order."""

    SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def __init__(self, f):
        self.f = f

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) < n:
            raise EOFError
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip_value(self, kind: int) -> int | None:
        """Skip one value; a u32 (the alignment's type) is returned."""
        if kind == 8:
            self.f.seek(self.u64(), 1)
        elif kind == 9:
            item, count = self.u32(), self.u64()
            if item in self.SCALAR_BYTES:
                self.f.seek(self.SCALAR_BYTES[item] * count, 1)
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind == 4:
            return self.u32()
        elif kind in self.SCALAR_BYTES:
            self.take(self.SCALAR_BYTES[kind])
        else:
            raise ValueError(f"unknown value type {kind}")
        return None


def check_gguf(path: Path) -> None:
    """The file is GGUF (v2 or later) and holds the data of every tensor it lists."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            reader = _GgufReader(f)
            if reader.take(4) != b"GGUF":
                raise ValueError("no GGUF magic")
            if reader.u32() < 2:
                return  # version 1: 32-bit counts; left to the converter
            num_tensors, num_kv = reader.u64(), reader.u64()
            alignment = 32
            for _ in range(num_kv):
                key, kind = reader.string(), reader.u32()
                value = reader.skip_value(kind)
                if key == b"general.alignment" and value:
                    alignment = value
            end = 0
            for _ in range(num_tensors):
                reader.string()
                shape = [reader.u64() for _ in range(reader.u32())]
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(reader.u32())]
                offset = reader.u64()
                elements = 1
                for dim in shape:
                    elements *= dim
                end = max(end, offset + elements // block * block_bytes)
            data_start = -(-f.tell() // alignment) * alignment
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except EOFError:
        raise ValueError(f"{path} is truncated: it ends inside its header; {_AGAIN}") from None
    except (ValueError, KeyError, struct.error) as exc:
        raise ValueError(f"{path} is not a readable GGUF file ({exc})") from None
    if data_start + end > size:
        raise ValueError(f"{path} is truncated: its tensors need {data_start + end:,} bytes and the file has {size:,}; "
                         f"{_AGAIN}")
