"""Reading pickled files from folders a user may have been handed, without running anything in them.

Policy, run and dataset folders get shared, and unpickling a file can call any function it names.
kilovla's own pickled files hold only plain data, so everything it unpickles from a folder is read
through an allowlist of the types those files hold; anything else is refused with an
`UnsafeFileError` naming the file, before any object of it is built:

- `load_torch(path)`: ``torch.load(weights_only=True)`` (tensors, containers, numbers, strings) plus
  numpy arrays of plain dtypes, for optimizer.pt and rng.pt (numpy's RNG state is a uint32 array),
  learner.pt, and LIBERO's init states (float64 arrays saved with torch.save). No object arrays.
- `read_dcp_metadata(path)`: an FSDP checkpoint's ``state/.metadata`` (torch.distributed.checkpoint
  unpickles it with plain ``pickle.load``) through `DcpMetadataUnpickler`, which admits only DCP's
  own metadata dataclasses, ``torch.Size``, torch dtypes and layouts, ``OrderedDict`` and paths.
- `load_dcp(state, folder)`: ``dcp.load`` with that metadata reader (`RestrictedFileSystemReader`)
  and `WeightsOnlyLoadPlanner`, which reads the non-tensor items (an optimizer's param_groups: DCP
  torch.saves each one into the shards and loads it with ``weights_only=False``) as `load_torch` does.
  DCP's own tensor reads are already ``weights_only=True``.

    >>> load_torch("run/checkpoints/step_000100/rng.pt")["numpy"][0]
    'MT19937'

Weights themselves are safetensors and small state is JSON: neither can run code, and nothing here
is needed for them. Importing this module imports torch.distributed.checkpoint (about a second):
import it where a file is read.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from kilovla.errors import KilovlaError

try:
    from numpy._core.multiarray import _reconstruct  # numpy 2
except ImportError:  # numpy 1.26
    from numpy.core.multiarray import _reconstruct

# Plain numeric dtypes only: an object array's elements would be arbitrary pickled objects.
_NUMPY_DTYPES = [type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                              np.uint32, np.uint64, np.float16, np.float32, np.float64)]
# A file written under numpy 1.x names numpy.core, one under 2.x numpy._core: the same function.
NUMPY_GLOBALS = [(_reconstruct, "numpy.core.multiarray._reconstruct"),
                 (_reconstruct, "numpy._core.multiarray._reconstruct"), np.ndarray, np.dtype, *_NUMPY_DTYPES]

_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name: torch.strided
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
}


class UnsafeFileError(KilovlaError):
    """A file asks to unpickle something outside the allowlist; it was refused and nothing of it ran."""


def _refused(source: str | Path, what: str) -> UnsafeFileError:
    return UnsafeFileError(f"{source}: not loaded: it would unpickle {what}, which kilovla's own files never hold "
                           "(unpickling a file from elsewhere can run code)")


def _refused_name(message: str) -> str | None:
    """The global or class named in torch's weights-only refusal (which is several lines of advice)."""
    for pattern in (r"GLOBAL ([\w.]+) was not an allowed global", r"GLOBAL ([\w.]+) whose module \w+ is blocked",
                    r"but got <class '([\w.]+)'>"):
        found = re.search(pattern, message)
        if found:
            return found.group(1)
    return None


def _load_weights_only(f, source: str | Path) -> Any:
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            return torch.load(f, weights_only=True)
    except pickle.UnpicklingError as e:
        name = _refused_name(str(e))
        if name is not None:
            raise _refused(source, name) from None
        detail = str(e).partition("WeightsUnpickler error:")[2].strip() or str(e).strip()
        raise KilovlaError(f"{source}: cannot read as a torch.save file of plain data: "
                           f"{detail.splitlines()[0][:300]}") from None
    except (RuntimeError, EOFError, ValueError) as e:  # not a torch.save file, or a truncated one
        raise KilovlaError(f"{source}: cannot read: {str(e).strip().splitlines()[0][:300]}") from None


def load_torch(path: str | Path) -> Any:
    """torch.load(path) admitting only tensors, plain containers and numbers, and numpy arrays of plain
    dtypes; anything else raises `UnsafeFileError` naming the file, before it is built."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _load_weights_only(f, path)
    except OSError as e:
        raise KilovlaError(f"{path}: cannot read: {e.strerror or e}") from None


# -- torch.distributed.checkpoint ----------------------------------------------------------------------
class DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, admitting only the globals DCP's metadata is made of."""

    def __init__(self, file, source: str | Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        allowed = name in _DCP_METADATA_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)))
        if not allowed:
            raise _refused(self.source, f"{module}.{name}")
        return super().find_class(module, name)


def read_dcp_metadata(path: str | Path) -> Metadata:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = DcpMetadataUnpickler(f, path).load()
    except OSError as e:
        raise KilovlaError(f"{path}: cannot read: {e.strerror or e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise KilovlaError(f"{path}: not torch.distributed.checkpoint metadata: {e}") from None
    if not isinstance(metadata, Metadata):
        raise KilovlaError(f"{path}: not torch.distributed.checkpoint metadata (holds a {type(metadata).__name__})")
    return metadata


class RestrictedFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` goes through `DcpMetadataUnpickler` instead of pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reading the non-tensor items as `load_torch` does (DCP's own: weights_only=False)."""

    def __init__(self, folder: str | Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.folder = Path(folder)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        shard = self.folder / self.metadata.storage_data[read_item.storage_index].relative_path
        obj = _load_weights_only(value, f"{shard} (item {read_item.dest_index.fqn})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_dcp(state: dict, folder: str | Path, *, no_dist: bool = False) -> None:
    """``dcp.load(state, folder)`` with the metadata and the non-tensor items read through the allowlists.

    A failure comes out as the exception that caused it (an `UnsafeFileError` first), not as DCP's
    CheckpointException, which derives from BaseException and carries every rank's traceback."""
    reader = RestrictedFileSystemReader(folder)
    # Refused here, once per rank, in one line: inside dcp.load a failed read is only logged, then
    # retried as a rank-local metadata file, and what reaches the caller is "metadata is None".
    reader.read_metadata()
    try:
        with warnings.catch_warnings():
            if no_dist:  # "assuming the intent is to load in a single process": it is, and we said so
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(folder), no_dist=no_dist)
    except CheckpointException as e:
        causes = [exc for exc, _ in (e.failures[rank] for rank in sorted(e.failures))]
        unsafe = [c for c in causes if isinstance(c, UnsafeFileError)]
        raise (unsafe or causes)[0] from None
