"""Reading `torch.distributed.checkpoint` (DCP) files without running code from them.

DCP's stock reader unpickles a checkpoint's ``.metadata`` with ``pickle.load``, and its default load planner reads
every non-tensor value (optimiser param groups, step counts) with ``torch.load(weights_only=False)``: a crafted
sharded checkpoint (``k3 convert-ckpt``, ``k3 eval``, ``k3 train --resume``) could name any callable and have it
run. The single-process format already refuses that (`k3.train.checkpoint`: ``weights_only=True``); here the
metadata is unpickled with an allowlist of DCP's own metadata classes, torch dtypes, layouts and sizes, and paths
(`Reader`, read as a regular file of bounded size), and the non-tensor values with ``weights_only=True``
(`LoadPlanner`). Anything else is a ValueError naming the file.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from k3.files import DATA_LIMIT, open_regular

__all__ = ["LoadPlanner", "Reader"]

#: What a DCP ``.metadata`` may name: the classes DCP writes there (``dcp.save`` of model and optimiser states).
_METADATA_CLASSES = {
    **{(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    (_StorageInfo.__module__, "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a layout by its name, nothing else
    **{("pathlib", name): getattr(pathlib, name) for name in ("PosixPath", "PurePosixPath", "PureWindowsPath")},
}


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that finds only `_METADATA_CLASSES` and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_CLASSES.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class: refused")
        return found


class Reader(dcp.FileSystemReader):
    """DCP's file reader, its metadata unpickled by an allowlist (module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.checkpoint_id) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open_regular(path, DATA_LIMIT) as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as err:  # an UnpicklingError, or what a refused or truncated stream raises
                raise ValueError(f"{path}: not DCP metadata ({type(err).__name__}: {err})") from err
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: not DCP metadata (a {type(metadata).__name__})")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor values read with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as err:  # torch.load raises UnpicklingError (and others) for a refused or foreign value
            raise ValueError(f"{read_item.dest_index.fqn}: not a plain value ({type(err).__name__}: {err})") from err
        plain = io.BytesIO()
        torch.save(loaded, plain)  # what weights_only=True accepted, handed on in the form the stock planner reads
        plain.seek(0)
        super().load_bytes(read_item, plain)
