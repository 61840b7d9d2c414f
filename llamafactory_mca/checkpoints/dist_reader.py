"""Read a Megatron dist checkpoint one region at a time, in a plain process (no torchrun, no process group).

The merge turns a checkpoint of any saved layout into HF weights on one CPU host, even for a model
larger than its memory. A Megatron ``torch_dist`` checkpoint stores *global* tensors whatever TP/PP/EP wrote it, so
this reader needs no model and no layout: it asks torch DCP's metadata which stored chunks overlap the requested
region and reads only those (``torch.distributed.checkpoint.load(..., no_dist=True)`` with a region planner).

Format assumptions (checked with megatron-core 0.16.1 and torch 2.14; DCP's format is stable since torch 2.4):

- ``metadata.json`` names ``sharded_backend: torch_dist`` (Megatron's default; zarr is not read). The DCP
  ``.metadata`` file is written last, so without it the save did not finish. ``FullyParallelSaveStrategyWrapper``
  changes only which rank writes a chunk, not the format.
- Homogeneous layers are stacked: ``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, rows,
  hidden]`` and ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[num_layers, num_experts, 2 * ffn,
  hidden]``. When layers differ (``moe_layer_freq`` a list or > 1, heterogeneous specs, ``singleton_local_shards``)
  Megatron writes one key per global layer, ``decoder.layers.<i>.…``; ``read_layer`` hides the difference.
  ``singleton_local_shards`` also gives each expert and gate/up half its own key, which ``read_layer`` leaves as is.
- A chunk is the unit of I/O: DCP stores each as one ``torch.save`` blob and loads it whole before copying the
  overlap out. Megatron's chunks are one layer x one TP shard (x one expert; the swiglu factory stores the gate and
  up halves of ``linear_fc1`` apart), so a layer or expert region reads only its own bytes and peak memory is the
  region plus one chunk. Gated ``linear_fc1`` weights read back as ``[gate; up]``, as an unsplit model holds them.
- Keys starting with ``optimizer.`` are optimizer states, possibly in the distributed optimizer's flattened layout;
  they are listed only when asked for. ShardedObjects (``_extra_state``, RNG states) are not read; ``common``
  reads the non-sharded rest of the state (``common.pt``).
- Every stored item, tensor or object, is one ``torch.save`` zip archive at an offset of a ``.distcp`` file, each
  of its records with a CRC-32 that torch does not check. ``find_corrupt_record`` checks an item's structure (its
  directory, every record's header) and the CRC-32 of its small records (the pickled part), not its large tensors.

A corrupt file is named. torch DCP's own errors name none: it wraps the failure of ``torch.load`` (whose message
advises retrying with ``weights_only=False``) in a ``CheckpointException``, a BaseException that prints both
tracebacks. Reads here go one file at a time, so a failure carries its file; a failed Megatron load (a resume)
asks ``describe_load_failure``, which finds the file by its structure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import operator
import os
import re
import warnings
import zipfile
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from ..errors import UserError


Index = int | slice | tuple[int | slice, ...]

CONFIG_FILE = "metadata.json"  # megatron.core.dist_checkpointing.core.CONFIG_FNAME
DCP_METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
OPTIMIZER_PREFIX = "optimizer."


class UnreadableFile(Exception):
    """A data file torch could not read (``path``), with torch's error (``error``)."""

    def __init__(self, path: str, error: BaseException) -> None:
        super().__init__(path, error)
        self.path, self.error = path, error


class _CachedMetadataReader(dcp.FileSystemReader):
    """``dcp.load`` re-reads ``.metadata`` on every call; a merge makes thousands of calls, so read it once. Reads
    one data file at a time, so that a failure says which (``UnreadableFile``)."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as err:
                raise UnreadableFile(os.path.join(self.path, name), err) from err
        done: Future[None] = Future()
        done.set_result(None)
        return done


def root_cause(err: BaseException) -> BaseException:
    """The exception behind torch DCP's ``CheckpointException`` (one per failed rank, with its stack), or ``err``."""
    for _ in range(8):  # a wrapped failure may itself be wrapped
        failures = getattr(err, "failures", None)
        if not isinstance(failures, dict) or not failures:
            break
        inner = next(iter(failures.values()))
        err = inner[0] if isinstance(inner, tuple) else inner
    return err


_TORCH_DOCS = "\n\nCheck the documentation of torch.load"


def describe_error(err: BaseException) -> str:
    """One short line for a failed read: the exception's type and first sentence, without the advice torch adds
    (to retry with ``weights_only=False``, which does not help a corrupt file; what a miniz error may mean)."""
    err = root_cause(err)
    if isinstance(err, UnreadableFile):
        err = err.error
    text = str(err).strip()
    if text.startswith("Weights only load failed"):  # the unpickler's own error follows torch's advice
        text = text.split(_TORCH_DOCS)[0]
        if "WeightsUnpickler error:" in text:
            text = text.rsplit("WeightsUnpickler error:", 1)[1]
        elif "\n\n" in text:
            text = text.rsplit("\n\n", 1)[1]
        else:
            text = text[len("Weights only load failed."):]
        text = text.strip()
    line = text.splitlines()[0].strip() if text else ""
    line = re.split(r"\.\s", line, maxsplit=1)[0].rstrip(".")[:200]
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


class _ItemsPlanner(DefaultLoadPlanner):
    """Loads exactly the given ReadItems into ``state_dict[fqn]``, a buffer shaped like the requested region.

    The default planner would plan the whole tensor. These items come from DCP's resharding helper with the region
    as the "local chunk", so their destinations are relative to the region, which the default lookup rejects.
    """

    def __init__(self, items: list[ReadItem]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items = items

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self.items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


def _region(index: Index, shape: torch.Size) -> tuple[list[int], list[int], list[int]]:
    """Offsets and sizes of ``index`` in a tensor of ``shape``, and the result's shape (an int drops its axis)."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape):
        raise IndexError(f"index {index!r} has more entries than the tensor has dimensions ({tuple(shape)})")
    offsets, sizes, kept = [], [], []
    for dim, size in enumerate(shape):
        item = items[dim] if dim < len(items) else slice(None)
        if isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step != 1:
                raise ValueError(f"slices with a step are not supported (got {item} for dimension {dim})")
            offsets.append(start)
            kept.append(max(stop - start, 0))
            sizes.append(kept[-1])
        else:
            i = operator.index(item)
            if not -size <= i < size:
                raise IndexError(f"index {item} is out of range for dimension {dim} of size {size}")
            offsets.append(i % size)
            sizes.append(1)
    return offsets, sizes, kept


def _describe_folder(path: str) -> str:
    """What the folder is instead, so that the error says where to point."""
    names = os.listdir(path)
    if not names:
        return " The folder is empty."
    if any(n.endswith(".safetensors") for n in names) or "config.json" in names:
        return " It looks like a Hugging Face model folder (safetensors/config.json), which needs no merging."
    nested = [n for n in sorted(names) if os.path.isfile(os.path.join(path, n, CONFIG_FILE))]
    return f" Its subfolder {nested[0]!r} is one; point at {os.path.join(path, nested[0])}." if nested else ""


def _load(state: dict, items: list[ReadItem], reader: dcp.FileSystemReader) -> None:
    """``dcp.load`` of exactly ``items``; its CheckpointException (a BaseException) comes back as the exception
    inside it, so that ``except Exception`` sees it."""
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": a plain process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is")
        try:
            dcp.load(state, storage_reader=reader, planner=_ItemsPlanner(items), no_dist=True)
        except CheckpointException as err:
            cause = root_cause(err)
            if isinstance(cause, Exception):
                raise cause from None
            raise


class _Slice(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file of their own (one stored item)."""

    def __init__(self, file: io.BufferedReader, start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(base + offset, self._length))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._pos)
        if count <= 0:
            return 0
        self._file.seek(self._start + self._pos)
        data = self._file.read(count)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


_SMALL_RECORD = 1 << 16  # a record this small (the pickle, torch's version markers) is read to check its CRC-32


def _check_record(file: io.BufferedReader, start: int, length: int) -> None:
    """Raise if the ``torch.save`` archive at ``start`` is broken: its directory, every record's local header, and
    the CRC-32 of its small records (the pickled structure); a large tensor's bytes are not read."""
    with zipfile.ZipFile(_Slice(file, start, length)) as archive:
        for info in archive.infolist():
            with archive.open(info) as record:  # checks the local header against the directory
                if info.file_size <= _SMALL_RECORD and info.CRC:
                    record.read()  # zipfile compares the CRC-32 at the end


class DistCheckpointReader:
    """Global tensors of a Megatron ``torch_dist`` checkpoint, read one region at a time without a process group."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        self.config = self._read_config()
        if not os.path.isfile(os.path.join(self.path, DCP_METADATA_FILE)):
            raise UserError(f"{self.path} is not a complete Megatron dist checkpoint: it has {CONFIG_FILE} but no "
                             f"torch DCP {DCP_METADATA_FILE} file, which is written last; the save did not finish "
                             "or the folder was copied incompletely.")
        try:
            metadata = dcp.FileSystemReader(self.path).read_metadata()
            if not isinstance(metadata, Metadata):
                raise TypeError(f"it holds a {type(metadata).__name__}")
        except Exception as e:
            raise UserError(f"{self.path} is not a readable Megatron dist checkpoint: its {DCP_METADATA_FILE} "
                            f"file {os.path.join(self.path, DCP_METADATA_FILE)} is truncated or corrupt "
                            f"({describe_error(e)}).") from e
        self._check_data_files(metadata)
        self.metadata = metadata
        self._storage = _CachedMetadataReader(self.path, metadata)
        self._by_layer: dict[str, tuple[list[int], list[ChunkStorageMetadata], int]] = {}

    def _check_data_files(self, metadata: Metadata) -> None:
        """Every data file ``.metadata`` refers to exists and is long enough (a copy or save cut short)."""
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        missing = sorted(name for name in needed if not os.path.isfile(os.path.join(self.path, name)))
        if missing:
            raise UserError(f"{self.path} is an incomplete Megatron dist checkpoint: {DCP_METADATA_FILE} refers "
                            f"to data files that are missing: {', '.join(missing)}.")
        for name, size in sorted(needed.items()):
            have = os.path.getsize(os.path.join(self.path, name))
            if have < size:
                raise UserError(f"{os.path.join(self.path, name)} is truncated: {have:,} bytes, but the checkpoint's "
                                f"{DCP_METADATA_FILE} needs {size:,}. The save or a copy was cut short.")

    def verify(self) -> None:
        """Beyond the metadata and data-file sizes checked on opening: the common state loads."""
        path = os.path.join(self.path, COMMON_FILE)
        if os.path.isfile(path):
            try:
                self.common(weights_only=False)
            except Exception as e:
                raise UserError(f"{path} is truncated or corrupt ({describe_error(e)}).") from e

    def find_corrupt_record(self) -> tuple[str, str] | None:
        """The first data file holding a stored item whose archive is broken, and why; None if all are sound.

        Reads each item's directory, headers and small records, not its large tensors: a few small reads per item
        (0.2 ms each on a local disk), for a failure path that must name the file (Megatron's load, like torch DCP's,
        does not)."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for info in self.metadata.storage_data.values():
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
        for name in sorted(by_file):
            path = os.path.join(self.path, name)
            with open(path, "rb") as file:
                for offset, length in sorted(set(by_file[name])):
                    try:
                        _check_record(file, offset, length)
                    except Exception as err:
                        return path, describe_error(err)
        return None

    def _read_config(self) -> dict:
        if not os.path.isdir(self.path):
            raise UserError(f"{self.path} is not a Megatron dist checkpoint: no such folder.")
        config_path = os.path.join(self.path, CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise UserError(f"{self.path} is not a Megatron dist checkpoint: it has no {CONFIG_FILE}."
                             + _describe_folder(self.path))
        try:
            with open(config_path) as f:
                config = json.load(f)
            backend = config["sharded_backend"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{self.path} is not a Megatron dist checkpoint: {config_path} is not a Megatron "
                             f"checkpoint config (JSON with 'sharded_backend'; {type(e).__name__}: {e}).") from e
        if backend != "torch_dist":
            raise UserError(f"{self.path} is a Megatron dist checkpoint with sharded_backend={backend!r}; only "
                             "'torch_dist' (Megatron's default) can be read. Convert it with Megatron first.")
        return config

    def _tensor_md(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            what = "an object, not a tensor" if md is not None else "no tensor"
            raise KeyError(f"{key!r} is {what} in the checkpoint at {self.path}")
        return md

    def __contains__(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata.get(key), TensorStorageMetadata)

    def keys(self, prefix: str | None = None, optimizer: bool = False) -> list[str]:
        """Sorted tensor keys under ``prefix``; optimizer states only with ``optimizer=True`` or their prefix."""
        prefix = prefix or ""
        optimizer = optimizer or prefix.startswith(OPTIMIZER_PREFIX)
        return sorted(k for k, md in self.metadata.state_dict_metadata.items()
                      if isinstance(md, TensorStorageMetadata) and k.startswith(prefix)
                      and (optimizer or not k.startswith(OPTIMIZER_PREFIX)))

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self._tensor_md(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor_md(key).properties.dtype

    def read(self, key: str, index: Index = ()) -> torch.Tensor:
        """The region ``index`` of global tensor ``key``, reading only the stored chunks that overlap it.

        ``index`` is tensor indexing without steps: ``(layer,)`` or ``(layer, expert)`` selects (and drops) leading
        axes, slices keep theirs, missing trailing entries mean whole axes.
        """
        md = self._tensor_md(key)
        offsets, sizes, kept = _region(index, md.size)
        buffer = torch.empty(sizes, dtype=md.properties.dtype)
        if buffer.numel():
            region = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items = create_read_items_for_chunk_list(key, self._near(key, md, offsets, sizes), [region])
            # Saved chunks never overlap (each replica is written once), so a gap shows as a smaller total;
            # unchecked, it would come back as uninitialised memory.
            if sum(math.prod(item.lengths) for item in items) != buffer.numel():
                raise UserError(f"the checkpoint at {self.path} does not store all of {key}[{index!r}] (global "
                                 f"shape {tuple(md.size)}): no saved chunk covers part of it.")
            try:
                _load({key: buffer}, items, self._storage)
            except Exception as e:
                files = sorted({self.metadata.storage_data[item.storage_index].relative_path for item in items})
                file = e.path if isinstance(e, UnreadableFile) else \
                    ", ".join(os.path.join(self.path, f) for f in files)
                raise UserError(f"{file} is corrupt: reading {key} from it failed ({describe_error(e)}), so the "
                                f"dist checkpoint {self.path} cannot be read. Use another checkpoint, or copy this "
                                "one again from where it was saved.") from e
        return buffer.view(kept)

    def _near(self, key: str, md: TensorStorageMetadata, offsets: list[int], sizes: list[int]
              ) -> TensorStorageMetadata:
        """``md`` with only the chunks that may overlap the region on axis 0 (the layer axis, when stacked): DCP's
        helper sorts all chunks on every call, 15 ms for the ~30k chunks of an expert tensor of a 256-expert,
        58-layer model, more than the read itself, on each of tens of thousands of reads."""
        if not offsets:
            return md
        if key not in self._by_layer:
            chunks = sorted(md.chunks, key=lambda c: c.offsets[0])
            self._by_layer[key] = [c.offsets[0] for c in chunks], chunks, max(c.sizes[0] for c in chunks)
        starts, chunks, longest = self._by_layer[key]
        near = chunks[bisect_left(starts, offsets[0] - longest + 1):bisect_left(starts, offsets[0] + sizes[0])]
        return dataclasses.replace(md, chunks=near)

    def read_full(self, key: str) -> torch.Tensor:
        return self.read(key, ())

    def locate_layer(self, key: str, layer: int) -> tuple[str, tuple[int, ...]] | None:
        """Where global layer ``layer`` of a stacked ``….layers.<name>`` key is stored, as ``(key, index prefix)``:
        ``(key, (layer,))`` when layers are stacked, ``("….layers.<layer>.<name>", ())`` when saved per layer."""
        if key in self:
            return key, (layer,)
        per_layer = key.replace(".layers.", f".layers.{layer}.", 1)
        return (per_layer, ()) if per_layer in self else None

    def read_layer(self, key: str, layer: int, index: Index = ()) -> torch.Tensor:
        """Region ``index`` (e.g. ``(expert,)``) of global layer ``layer`` of ``key``, however layers were saved."""
        found = self.locate_layer(key, layer)
        if found is None:
            raise KeyError(f"the checkpoint at {self.path} has no tensor {key!r} (layers stacked) nor "
                           f"{key.replace('.layers.', f'.layers.{layer}.', 1)!r} (one key per layer)")
        return self.read(found[0], found[1] + (index if isinstance(index, tuple) else (index,)))

    def common(self, weights_only: bool = True) -> dict:
        """The non-sharded state in ``common.pt``; ``weights_only=False`` (trusted files) allows e.g. saved args."""
        path = os.path.join(self.path, COMMON_FILE)
        return torch.load(path, map_location="cpu", weights_only=weights_only) if os.path.isfile(path) else {}


def describe_load_failure(err: BaseException, directory: str) -> str:
    """One line for a failed load of the dist checkpoint at ``directory`` (Megatron's, torch DCP's): the corrupt
    file and why, where its structure shows one; otherwise the error itself, without torch's advice."""
    try:
        found = DistCheckpointReader(directory).find_corrupt_record()
    except UserError as checked:  # its metadata or a data file's size tells already
        return str(checked).rstrip(".")
    except Exception:
        found = None
    return f"{found[0]} is corrupt: {found[1]}" if found else describe_error(err)


@contextlib.contextmanager
def named_load_errors(directory: str) -> Iterator[None]:
    """Around a Megatron load of the dist checkpoint at ``directory``: its failure (torch DCP's BaseException
    included) becomes one UserError naming the corrupt file where one is found."""
    try:
        yield
    except UserError:
        raise
    except (Exception, CheckpointException) as err:
        raise UserError(f"loading the dist checkpoint {directory} failed ({describe_load_failure(err, directory)}): "
                        "its files are corrupt or were written by an incompatible version. Use another checkpoint, "
                        "or copy this one again from where it was saved.") from err
