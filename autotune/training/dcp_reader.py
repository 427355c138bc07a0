"""Reading ``torch.distributed.checkpoint`` folders without running code from them.

DCP keeps two pickles in a checkpoint folder: ``.metadata`` (``pickle.load``ed by
``FileSystemReader.read_metadata``) and the non-tensor values of the state dict inside the shard
files (``torch.load(weights_only=False)`` in ``DefaultLoadPlanner.load_bytes``: the optimizer's
param_groups, for one). Either would run whatever a crafted file names. Here the metadata is
unpickled with an allow-list of the classes DCP writes there, and the values with
``weights_only=True``; anything else is refused before it is built.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

METADATA_NAME = ".metadata"

_METADATA_MODULE = dcp_metadata.__name__
# Beyond the classes of torch.distributed.checkpoint.metadata: what a .metadata file written by
# torch 2.4 to 2.14 names (found by listing find_class calls on checkpoints of the built-in loop).
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name (a dict lookup)
    ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local")  # StorageMeta.checkpoint_id
      for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file names a class or function outside the allow-list; nothing was built."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or _is_dcp_metadata_class(module, name) or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{module}.{name}")

    def persistent_load(self, pid):
        raise UnsafeCheckpoint(f"persistent id {pid!r}")


def _is_dcp_metadata_class(module: str, name: str) -> bool:
    value = getattr(dcp_metadata, name, None) if module == _METADATA_MODULE else None
    return isinstance(value, type) and value.__module__ == _METADATA_MODULE


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def read_metadata(path) -> object:
    """The ``Metadata`` in a DCP ``.metadata`` file; ``UnsafeCheckpoint`` when it holds other
    objects (none of them is built), ``OSError``/``pickle.UnpicklingError``/... when damaged."""
    with open(path, "rb") as handle:
        metadata = _MetadataUnpickler(io.BytesIO(handle.read())).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpoint(f"a {type(metadata).__name__} instead of DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata goes through ``read_metadata`` above."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
        metadata = read_metadata(Path(self.path) / name)
        # What FileSystemReader.read_metadata does after loading (torch 2.4 onwards; the guards
        # are for releases where StorageMeta or load_id do not exist yet).
        if hasattr(dcp_metadata, "StorageMeta") and hasattr(self, "load_id"):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values load with ``weights_only=True``.

    The value is loaded safely, saved again (tensors and plain types only) and handed to the
    default planner, which places it in the state dict as every torch version does."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            safe = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"{read_item.dest_index.fqn}: {str(exc).splitlines()[0]}") from None
        buffer = io.BytesIO()
        torch.save(safe, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)
