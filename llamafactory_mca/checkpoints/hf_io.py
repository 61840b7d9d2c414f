"""Hugging Face safetensors in and out, a slice at a time.

Reading: each rank opens only the files that hold tensors it needs and reads only its slices
(``safe_open(...).get_slice``), so its peak host memory while loading is about its own shard.
Writing: sharded safetensors plus ``model.safetensors.index.json``, one tensor group at a time.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import UserError
from . import manifest


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files that travel with a model besides its weights.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
              "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
              "video_preprocessor_config.json")


MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers


def check_safetensors_files(path: str) -> None:
    """Every safetensors file in the folder ``path`` is whole: its header parses and the file is exactly as long as
    the header says; the files ``model.safetensors.index.json`` lists exist. Reads headers only (cheap: the
    launcher runs it before any worker starts)."""
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                listed = set(json.load(f)["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{index} is corrupt ({type(err).__name__}: {err}); download or save the model "
                            "again.") from err
        missing = sorted(listed - set(names))
        if missing:
            raise UserError(f"{os.path.join(path, missing[0])} is listed in {INDEX_NAME} but missing"
                            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: the model is "
                            "incomplete; download or save it again.")
    for name in names:
        check_safetensors_header(os.path.join(path, name))


def check_safetensors_header(file: str) -> None:
    """``file``'s header parses and describes exactly the file's length (a download or copy cut short, or garbage)."""
    size = os.path.getsize(file)
    fix = "Download or save the model again."
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > size - 8:
            raise UserError(f"{file} is truncated: {size:,} bytes, less than its safetensors header needs "
                            f"({8 + (length or 0):,}). {fix}")
        if length > MAX_HEADER_BYTES:
            raise UserError(f"{file} is corrupt: its safetensors header claims {length:,} bytes. {fix}")
        try:
            header = json.loads(f.read(length))
            end = max((int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise UserError(f"{file} is corrupt: its safetensors header does not parse ({type(err).__name__}). "
                            f"{fix}") from err
    needed = 8 + length + end
    if size < needed:
        raise UserError(f"{file} is truncated: {size:,} bytes, but its safetensors header describes {needed:,}. "
                        f"{fix}")
    if size > needed:
        raise UserError(f"{file} is corrupt: {size:,} bytes, but its safetensors header describes {needed:,}. {fix}")


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


class SafetensorsSource:
    """HF tensors by name from a folder of safetensors files; counts what it reads (tests use that).

    A tensor stored in MXFP4 (gpt-oss's hub checkpoints: ``<name>_blocks`` of packed 4-bit values and ``<name>_scales``
    of 8-bit exponents, 32 values a block) reads as ``<name>`` dequantized to bf16 by transformers' own function, as
    ``Mxfp4Config(dequantize=True)`` loads it; a slice along dim 0 (one expert) dequantizes that slice only."""

    def __init__(self, path: str, aliases: tuple[tuple[str, str], ...] = ()) -> None:
        self.path = path
        self._handles: dict[str, object] = {}
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, SINGLE_NAME)):
            self.weight_map = {name: SINGLE_NAME for name in self._open(SINGLE_NAME).keys()}
        else:
            raise UserError(f"{path} holds no Hugging Face safetensors weights (neither {SINGLE_NAME} nor "
                             f"{INDEX_NAME}). Point model_name_or_path at a model folder saved with save_pretrained.")
        # (prefix, other prefix): a tensor the files hold under the other spelling is read under ours (a family's
        # ``Vision.aliases``: a checkpoint may spell the tower or the language model's prefix otherwise)
        self._stored: dict[str, str] = {}
        for ours, theirs in aliases:
            for name in [n for n in self.weight_map if n.startswith(theirs)]:
                self._stored[ours + name[len(theirs):]] = name
        self.weight_map |= {name: self.weight_map[stored] for name, stored in self._stored.items()}
        self.bytes_read = 0
        self.tensors_read = 0

    def keys(self) -> list[str]:
        return list(self.weight_map)

    @property
    def files_opened(self) -> list[str]:
        return sorted(self._handles)

    def _open(self, file: str):
        handles = self._handles
        if file not in handles:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise UserError(f"{full} is listed in {INDEX_NAME} but missing: the checkpoint is incomplete "
                                 "(re-download or re-save it).")
            try:
                handles[file] = safe_open(full, "pt")
            except Exception as err:
                raise UserError(f"{full} cannot be read, it is truncated or corrupt ({err}). "
                                 "Re-download it.") from err
        return handles[file]

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        return self._open(self.weight_map[name]).get_slice(self._stored.get(name, name))

    def _mxfp4(self, name: str) -> bool:
        return name not in self.weight_map and f"{name}{MXFP4_BLOCKS}" in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        if self._mxfp4(name):  # blocks [E, out, in / 32, 16] -> [E, in, out]
            experts, rows, groups, width = self.shape(f"{name}{MXFP4_BLOCKS}")
            return experts, groups * width * 2, rows
        return tuple(self._slice(name).get_shape())

    def get(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if self._mxfp4(name):
            whole = dim is None or dim != 0
            blocks, scales = (self.get(f"{name}{part}", None if whole else 0, start, stop)
                              for part in (MXFP4_BLOCKS, MXFP4_SCALES))
            # here: transformers' dequantizer (transformers takes seconds to import); only MXFP4 checkpoints need it
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            tensor = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
            return tensor.narrow(dim, start, (stop or tensor.shape[dim]) - start) if whole and dim else tensor
        piece = self._slice(name)
        if not piece.get_shape():  # a scalar
            index: tuple = ()
        elif dim is None:
            index = (slice(None),)
        else:
            index = (slice(None),) * dim + (slice(start, stop),)
        try:
            tensor = piece[index]
        except Exception as err:
            raise UserError(f"reading {name!r} from {self.path} failed ({err}): the file is truncated or corrupt.") \
                from err
        # a scalar may be a bound that is no bound (Gemma 4's clipped linears: +-inf), never NaN
        if tensor.is_floating_point() and not (all_finite(tensor) if tensor.dim() else not tensor.isnan()):
            raise UserError(f"tensor {name!r} in {os.path.join(self.path, self.weight_map[name])} holds NaN or inf "
                            "values: the model file is corrupt (re-download or re-save it).")
        self.bytes_read += tensor.numel() * tensor.element_size()
        self.tensors_read += 1
        return tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in ``tensor``: its min and max in one pass (NaN propagates through both), 20x faster on a CPU
    than ``isfinite(...).all()``, which on a 10 GB checkpoint took most of the load."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


class ShardedWriter:
    """Writes tensors into ``model-0000k-of-0000n.safetensors`` files of at most ``max_shard_bytes``."""

    def __init__(self, directory: str, max_shard_bytes: int = 5 * 1024**3) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0
        os.makedirs(directory, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        part = f"part-{len(self._files):05d}.safetensors"
        save_file(self._pending, os.path.join(self.directory, part), metadata={"format": "pt"})
        self._files.append((part, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        if self._pending or not self._files:
            self._flush()
        if len(self._files) == 1:
            os.replace(os.path.join(self.directory, self._files[0][0]), os.path.join(self.directory, SINGLE_NAME))
            return
        weight_map = {}
        count = len(self._files)
        for k, (part, names) in enumerate(self._files):
            final = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
            os.replace(os.path.join(self.directory, part), os.path.join(self.directory, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.directory, INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)


def copy_side_files(source: str, target: str) -> list[str]:
    """Tokenizer, processor and generation files that sit beside the weights."""
    copied = []
    os.makedirs(target, exist_ok=True)
    for name in SIDE_FILES:
        if name != "config.json" and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(target, name))
            copied.append(name)
    return copied


def write_hf_config(hf_config: dict, directory: str, dtype: torch.dtype | None) -> None:
    config = dict(hf_config)
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        config["torch_dtype"] = name
        config["dtype"] = name
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def move_into(staging: str, output: str) -> None:
    """``staging`` (a finished export) becomes ``output``, with a manifest of its weight files (``manifest.py``:
    loading them later names a corrupt one); into an existing folder (a run's output_dir), its files replace the old
    weights, whose shard names may differ."""
    manifest.write_for(staging, [n for n in os.listdir(staging) if n.endswith(".safetensors") or n == INDEX_NAME])
    if not os.path.exists(output):
        os.replace(staging, output)
        return
    for name in os.listdir(output):
        if name.endswith(".safetensors") or name in (INDEX_NAME, manifest.MANIFEST_NAME):
            os.remove(os.path.join(output, name))
    for name in os.listdir(staging):
        os.replace(os.path.join(staging, name), os.path.join(output, name))
