"""Sharded safetensors checkpoints, memory-mapped (SPEC §10: 96 shards, ~1.45 TB).

`Shards` parses only the headers of a directory's shards (and its ``model.safetensors.index.json``) and hands
out tensors that are views of a copy-on-write memory map of their file: nothing is read from disk until a
tensor's pages are touched, so a layer's routed experts cost memory only once they are used. Every header
is checked (JSON, dtypes, shapes against byte ranges, ranges inside the file, the index against the files);
a problem is a `ValueError` naming the file and tensor. Shards, and the index, must be regular files
(`k3.files.open_regular`: a link to ``/dev/zero`` or a FIFO is refused before anything is read or mapped) named
inside the directory. `write_shards` writes a state dict back in the same layout, each file through
`k3.files.atomic_write`.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from k3.files import DATA_LIMIT, atomic_write, open_regular, read_json, write_text

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives: its file, dtype, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _header(path: Path) -> dict[str, Entry]:
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"{path}: not a safetensors file (header length {n}, file size {size})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read the safetensors header ({err})") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    base, entries = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: tensor {name!r} has an invalid header entry {info!r}") from err
        nbytes = math.prod(shape) * dtype.itemsize
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end and end - start == nbytes
                and base + end <= size and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) has byte range "
                             f"[{start}, {end}) inconsistent with its shape or past the end of the file ({size} bytes)")
        entries[name] = Entry(path, dtype, shape, base + start, base + end)
    return entries


class Shards:
    """The tensors of a checkpoint directory, by name, memory-mapped on demand."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = read_json(index, DATA_LIMIT)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from err
            strange = [name for name in files if not isinstance(name, str) or Path(name).name != name
                       or not name.endswith(".safetensors")]
            if strange:
                raise ValueError(f"{index}: lists {strange[0]!r}, not a .safetensors file name in {self.directory}")
        else:
            weight_map, files = None, sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.directory}: no safetensors weights found")
        self.entries: dict[str, Entry] = {}
        for name in files:
            path = self.directory / name
            if not path.exists():
                raise ValueError(f"{index}: lists {name}, which does not exist")
            for key, entry in _header(path).items():
                if key in self.entries:
                    raise ValueError(f"{path}: tensor {key!r} is also in {self.entries[key].file.name}")
                self.entries[key] = entry
        if weight_map is not None:
            for key, name in weight_map.items():
                if key not in self.entries or self.entries[key].file.name != name:
                    raise ValueError(f"{index}: maps {key!r} to {name}, which does not hold it")
        self._maps: dict[Path, mmap.mmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def tensor(self, name: str) -> Tensor:
        """A view of the memory-mapped file (copy-on-write: writing to it never changes the file)."""
        entry = self.entries[name]
        if entry.file not in self._maps:
            with open_regular(entry.file) as f:
                self._maps[entry.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(self._maps[entry.file]) < entry.end:
            raise ValueError(f"{entry.file}: shrank to {len(self._maps[entry.file])} bytes since its header was read; "
                             f"tensor {name!r} ends at byte {entry.end}")
        count = math.prod(entry.shape)
        if count == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(self._maps[entry.file], dtype=entry.dtype, count=count,
                                offset=entry.start).view(entry.shape)


def owned(t: Tensor) -> Tensor:
    """``t`` detached and contiguous in a storage of its own: safetensors refuses tensors that share one (such as
    `k3.model.packed.PackedExperts`' per-expert views of their stacked bytes)."""
    t = t.detach().contiguous()
    return t if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes else t.clone()


def write_shards(directory: str | os.PathLike, tensors: dict[str, Tensor], max_shard_bytes: int = 5 * 2**30,
                 prefix: str = "model") -> list[Path]:
    """Write ``tensors`` as ``prefix-0000i-of-0000n.safetensors`` (in order, each at most ``max_shard_bytes``
    unless one tensor is larger) plus the index, each atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = owned(t)
        size += nbytes
    paths, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        path = directory / f"{prefix}-{i:05d}-of-{len(groups):05d}.safetensors"
        with atomic_write(path) as tmp:
            save_file(group, str(tmp), metadata={"format": "pt"})
        paths.append(path)
        weight_map.update(dict.fromkeys(group, path.name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_text(directory / INDEX_FILE, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2))
    return paths
