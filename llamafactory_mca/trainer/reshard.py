"""The optimizer's state across a change of layout: TP, PP, VPP, EP, ETP, CP, DP, the distributed optimizer on or off.

Megatron's distributed optimizer saves its state as it holds it (``dp_reshardable``): per data-parallel group, flat
buckets of fp32 main parameters and Adam moments whose order, padding and split follow the layout that wrote them,
so they read back under another data-parallel size only. Megatron's model-space format (``fully_reshardable``)
reshards anywhere but gathers each group's whole state onto host memory at every save (12 bytes per parameter of the
rank's model shard, on every data-parallel rank, or on the first one with the save no longer parallel). We keep the
fast format and save beside it a small map (``bucket_map``): where in which bucket each parameter's model-space
pieces lie, a few integers per piece. A load under another layout reads, on each rank, only the pieces of its own
parameters (``BucketSource``) and hands the optimizer its slices (``load_model_space``). A plain optimizer's
checkpoint is in model space already (``ModelSpaceSource``), so the distributed optimizer may be switched on or off
between runs too.

A piece is one ShardedTensor of a parameter's sharded metadata: a factory splits one parameter into several (the
gate and up halves of a gated ``linear_fc1``, one per expert of a grouped MLP). Which of the parameter's elements a
piece holds is found by building it from a tensor of element indices: every factory Megatron has only views,
transposes or chunks, so each piece is a strided pattern (start, strides) over the parameter's flat data.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from ..checkpoints.dist_reader import DistCheckpointReader
from ..errors import UserError


STATES = ("param", "exp_avg", "exp_avg_sq")  # fp32 main parameter and Adam's moments


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where part of a parameter's local data lies in its global (model-space) tensor."""

    key: str
    offset: tuple[int, ...]  # in the global tensor, prepended (stacked-layer) axes included
    shape: tuple[int, ...]  # of the region; prepended axes are 1
    start: int  # the pattern over the parameter's flat data: element [i, j, ...] is at start + i*s0 + j*s1 + ...
    strides: tuple[int, ...]
    padded: bool = False  # allow_shape_mismatch (vocabulary padding): parts beyond the saved tensor stay zero


def _strided(values: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """(start, strides) when ``values`` (element indices) form a strided pattern with non-negative strides."""
    if values.numel() == 0:
        return None
    first = (0,) * values.ndim
    start = int(values[first])
    strides = []
    for dim, size in enumerate(values.shape):
        step = int(values[tuple(1 if d == dim else 0 for d in range(values.ndim))]) - start if size > 1 else 0
        if step < 0:
            return None
        strides.append(step)
    if not torch.equal(values, torch.as_strided(torch.arange(values.max() + 1), values.shape, strides, start)):
        return None
    return start, tuple(strides)


def pieces(meta: ShardedTensor | ShardedTensorFactory, shape: torch.Size) -> list[Piece] | None:
    """The model-space pieces of a parameter of ``shape`` whose sharded metadata is ``meta``; None where a piece is
    not a strided pattern of the parameter's data."""
    index = torch.arange(math.prod(shape)).view(shape)
    if isinstance(meta, ShardedTensorFactory):
        built = meta.build_fn(meta.key, index, meta.replica_id, None)  # one ShardedTensor, or a nest of them
        built = [built] if isinstance(built, ShardedTensor) else list(nested_values(built))
    else:
        built = [replace(meta, data=index, dtype=index.dtype)]
    found = []
    for sh in built:
        if not isinstance(sh, ShardedTensor):
            return None
        pattern = _strided(sh.data)
        if pattern is None:
            return None
        extra = sh.prepend_axis_num
        found.append(Piece(sh.key, tuple(sh.global_offset), (1,) * extra + tuple(sh.data.shape), pattern[0],
                           (0,) * extra + pattern[1], bool(sh.allow_shape_mismatch)))
    return found


def parameter_metadata(model_state: dict) -> dict[torch.Tensor, Any]:
    """Parameter -> its ShardedTensor or factory, from the model's sharded state dict (whose data are the
    parameters themselves)."""
    sharded, _ = extract_sharded_tensors_and_factories(model_state)
    return {sh.data: sh for sh in nested_values(sharded)}


def _chained(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_distributed(optimizer: Any) -> bool:
    return any(isinstance(opt, DistributedOptimizer) for opt in _chained(optimizer))


# ---- saving: the bucket map ---------------------------------------------------------------------------------------

Row = tuple  # (bucket key, parameter start in the bucket, parameter numel, *Piece fields)


def bucket_map(optimizer: Any, model_state: dict, state_keys: set[str] | None) -> list[Row] | None:
    """Every parameter of the distributed optimizer's buckets as rows (bucket key, start in the bucket, numel, its
    pieces), from the first rank of each data-parallel group, gathered onto every rank (collective). None where a
    piece cannot be described or a bucket key is not among ``state_keys`` (the tensors about to be saved, when
    given)."""
    meta = parameter_metadata(model_state)
    chained = _chained(optimizer)
    rows: list[Row] | None = []
    for index, opt in enumerate(chained):
        if not isinstance(opt, DistributedOptimizer) or opt.data_parallel_group.rank() != 0:
            continue
        prefix = f"chained_{index}." if len(chained) > 1 else ""
        for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
            buffer = opt.buffers[gbuf_idx]
            for dtype in gbuf_range_maps:
                for bucket_idx, bucket in enumerate(buffer.buckets):
                    key = (f"{prefix}optimizer.distributed.dp_group_idx_{opt.data_parallel_group_idx}"
                           f".gbuf_idx_{gbuf_idx}.dtype_{dtype}.bucket_idx_{bucket_idx}")
                    rows = _bucket_rows(key, bucket, buffer, meta, state_keys, rows)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, rows)
    if any(part is None for part in gathered):
        return None
    return sorted({row for part in gathered for row in part})


def _bucket_rows(key: str, bucket: Any, buffer: Any, meta: dict, state_keys: set[str], rows: list | None
                 ) -> list | None:
    if rows is None or (state_keys is not None and f"{key}.param" not in state_keys):
        return None
    for param in bucket.params_list:
        start = buffer.param_index_map[param][0] - bucket.offset
        found = pieces(meta[param], param.shape) if param in meta else None
        if found is None:
            return None
        rows += [(key, start, param.numel(), *dataclasses.astuple(piece)) for piece in found]
    return rows


# ---- loading: sources of model-space state ------------------------------------------------------------------------

def _overlap(offset: tuple, shape: tuple, other_offset: tuple, other_shape: tuple) -> tuple[list, list] | None:
    lo = [max(a, b) for a, b in zip(offset, other_offset)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, other_offset, other_shape)]
    return (lo, hi) if all(b > a for a, b in zip(lo, hi)) else None


def _window(lo: list, hi: list, origin: tuple) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin))


class BucketSource:
    """Model-space regions read out of a distributed optimizer's buckets, through the saved bucket map."""

    def __init__(self, reader: DistCheckpointReader, rows: list[Row]) -> None:
        self.reader = reader
        self.by_key: dict[str, list[tuple[str, int, int, Piece]]] = defaultdict(list)
        for bucket, start, numel, *fields in rows:
            piece = Piece(fields[0], tuple(fields[1]), tuple(fields[2]), fields[3], tuple(fields[4]), fields[5])
            self.by_key[piece.key].append((bucket, start, numel, piece))
        self._cache: dict[tuple[str, str, int], torch.Tensor] = {}

    def fill(self, state: str, key: str, offset: tuple, out: torch.Tensor, covered: torch.Tensor) -> None:
        for bucket, start, numel, piece in self.by_key.get(key, ()):
            found = _overlap(offset, tuple(out.shape), piece.offset, piece.shape)
            if found is None:
                continue
            lo, hi = found
            flat = self._parameter(state, bucket, start, numel)
            saved = torch.as_strided(flat, piece.shape, piece.strides, piece.start)
            out[_window(lo, hi, offset)] = saved[_window(lo, hi, piece.offset)]
            covered[_window(lo, hi, offset)] = True

    def _parameter(self, state: str, bucket: str, start: int, numel: int) -> torch.Tensor:
        """One saved parameter's flat state (kept while the caller assembles one parameter: ``release``)."""
        cache_key = (state, bucket, start)
        if cache_key not in self._cache:
            self._cache[cache_key] = self.reader.read(f"{bucket}.{state}", slice(start, start + numel))
        return self._cache[cache_key]

    def release(self) -> None:
        self._cache.clear()


class ModelSpaceSource:
    """Model-space regions of a plain (non-distributed) optimizer's checkpoint: ``optimizer.state.<state>.<key>``;
    the fp32 main parameter is ``fp32_param`` in mixed precision, the model's own weight in fp32 runs."""

    def __init__(self, reader: DistCheckpointReader) -> None:
        self.reader = reader
        self.keys: dict[str, str] = {}
        for key in reader.keys(optimizer=True):
            head, _, rest = key.partition(".")  # a chained optimizer's prefix, chained_<i>.
            self.keys.setdefault(rest if head.startswith("chained_") else key, key)

    def _key(self, state: str, key: str) -> str | None:
        names = (f"optimizer.state.fp32_param.{key}", key) if state == "param" else (f"optimizer.state.{state}.{key}",)
        for name in names:
            if name in self.keys or (name == key and key in self.reader):
                return self.keys.get(name, name)
        return None

    def fill(self, state: str, key: str, offset: tuple, out: torch.Tensor, covered: torch.Tensor) -> None:
        name = self._key(state, key)
        if name is None:
            return
        found = _overlap(offset, tuple(out.shape), (0,) * out.ndim, tuple(self.reader.shape(name)))
        if found is not None:
            lo, hi = found
            region = self.reader.read(name, tuple(slice(a, b) for a, b in zip(lo, hi)))
            out[_window(lo, hi, offset)] = region.to(out.dtype)
            covered[_window(lo, hi, offset)] = True

    def release(self) -> None:
        pass


# ---- loading: into this run's optimizer ---------------------------------------------------------------------------

Target = tuple[torch.Tensor, Callable[[dict[str, torch.Tensor]], None]]


def _targets(optimizer: Any) -> Iterator[Target]:
    """(model parameter, a function that takes its full local state {param, exp_avg, exp_avg_sq}) for every
    parameter this rank's optimizer updates, whatever Megatron optimizer holds it."""
    for opt in _chained(optimizer):
        inner = opt.optimizer
        if isinstance(opt, DistributedOptimizer):
            for gbuf_range_maps in opt.gbuf_ranges:
                for per_bucket in gbuf_range_maps.values():
                    for range_map in per_bucket:
                        for model_param, ranges in range_map["param_map"].items():
                            group, order = opt.model_param_group_index_map[model_param]
                            main = inner.param_groups[group]["params"][order]
                            yield model_param, _writer(inner, main, slice(ranges["param"].start, ranges["param"].end))
        elif hasattr(opt, "float16_groups"):  # mixed precision: fp32 copies of the bf16/fp16 parameters
            for low, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for model_param, main in zip(low, mains):
                    yield model_param, _writer(inner, main, None)
            for params in opt.fp32_from_fp32_groups:
                for param in params:
                    yield param, _writer(inner, param, None)
        else:  # fp32: the parameters are the main parameters
            for group in inner.param_groups:
                for param in group["params"]:
                    yield param, _writer(inner, param, None)


def _writer(inner: torch.optim.Optimizer, main: torch.Tensor, flat: slice | None):
    def write(full: dict[str, torch.Tensor]) -> None:
        sources = {name: (full[name].reshape(-1)[flat] if flat is not None else full[name]) for name in STATES}
        if hasattr(inner, "set_scaled_state"):  # precision-aware (param_remainders): ``main`` is the bf16 shard
            for name, src in sources.items():
                inner.set_scaled_state(main, "master_param" if name == "param" else name, src)
            return
        destinations = {"param": main, **{k: v for k, v in inner.state[main].items() if k in STATES}}
        for name, dst in destinations.items():
            dst.data.copy_(sources[name].reshape(dst.shape))
    return write


def load_model_space(optimizer: Any, model_state: dict, source: BucketSource | ModelSpaceSource, where: str) -> None:
    """Set every fp32 main parameter and Adam moment this rank's optimizer holds from ``source`` (the optimizer's
    state must be allocated). A region the checkpoint does not hold is a UserError naming it (``where``)."""
    meta = parameter_metadata(model_state)
    with torch.no_grad():
        for model_param, write in _targets(optimizer):
            found = pieces(meta[model_param], model_param.shape) if model_param in meta else None
            if found is None:
                raise UserError(f"cannot lay out the optimizer state of a parameter of shape "
                                f"{tuple(model_param.shape)} in model space (no sharded metadata describes it).")
            full = {}
            for state in STATES:
                flat = torch.zeros(model_param.numel(), dtype=torch.float32)
                for piece in found:
                    region = torch.zeros(piece.shape, dtype=torch.float32)
                    covered = torch.zeros(piece.shape, dtype=torch.bool)
                    source.fill(state, piece.key, piece.offset, region, covered)
                    if not piece.padded and not bool(covered.all()):
                        raise UserError(f"{where} holds no optimizer state ({state}) for part of {piece.key} "
                                        f"(offset {piece.offset}, shape {piece.shape}): it was written for other "
                                        "trainable parameters (another model, finetuning_type or freeze setting).")
                    torch.as_strided(flat, piece.shape, piece.strides, piece.start).copy_(region)
                full[state] = flat.view(model_param.shape).to(model_param.device)
            write(full)
            source.release()
