"""What a training checkpoint holds and how a run comes back from it: model, optimizer, RNG, LR schedule,
consumed micro-batches. The folder itself (names, side files, tmp-then-rename) is ``checkpoints.py``'s.

Saved fully in parallel; the distributed optimizer's state in Megatron's dp-reshardable format with our bucket map
beside it (``reshard.py``), so a run resumes under any layout: as saved where the optimizer's buckets are laid out
the same (a data-parallel change included), re-laid out from model space otherwise. The model's tensors are global
and reshard by themselves; RNG states come back where the (pp, tp) layout is the same. A crash mid-save leaves a
``tmp-`` folder, which resume ignores (and the next save removes).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from ..checkpoints import (
    SideFiles,
    checkpoint_path,
    dist_checkpoint_dir,
    layout_change,
    newest_intact,
    read_layout,
    write_folder,
)
from ..checkpoints.dist_reader import DistCheckpointReader, describe_load_failure
from ..errors import UserError
from ..models.auto import check_finite
from ..parallel import ParallelLayout
from . import reshard
from .faults import before_commit, kill_writer
from .optim import inner_optimizers, step_counter, use_fused_adam


logger = logging.getLogger(__name__)

# dp_reshardable: every rank writes its own optimizer shard (no gathering) and a resume may change the
# data-parallel size; megatron-core 0.16 no longer saves the older flattened "model space" format.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


def _rng_object(layout_key: tuple[int, int]) -> ShardedObject:
    """Per (pp, tp) rank RNG states, replicated over data parallel (Megatron-LM's convention)."""
    state = {"random": random.getstate(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}

    state["tracker"] = get_cuda_rng_tracker().get_states()
    return ShardedObject("rng_state", state, layout_key,
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _layout_key() -> tuple[int, int]:
    return ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()


def optimizer_step_count(optimizer: Any) -> float | None:
    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            if "step" in state:
                return float(state["step"])
    return None


def _set_step_counters(optimizer: Any, step: float, only_missing: bool) -> None:
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param)
                if state is not None and (not only_missing or "step" not in state):
                    state["step"] = step_counter(group, step)


def _restore_step_count(optimizer: Any, step: float | None) -> None:
    """megatron-core 0.16.1's distributed optimizer without apex/TE reloads Adam's step counter as 0 (its
    per-group step does not survive the dp-reshardable round trip), which changes the bias correction of
    the first update after a resume. We save the counter ourselves and put it back."""
    if step is not None:
        _set_step_counters(optimizer, step, only_missing=False)


def _init_optimizer_state(optimizer: Any) -> None:
    """A fresh optimizer has no state yet; Megatron's distributed optimizer (without apex/TE) needs its moments and
    step counter to describe what it will load."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer) and getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, opt.config)
    _set_step_counters(optimizer, 0.0, only_missing=True)


def _optimizer_state(model_state: dict, optimizer: Any, is_loading: bool) -> dict:
    if is_loading:
        _init_optimizer_state(optimizer)
    return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=_OPTIM_METADATA)


def _dp_group():
    return ps.get_data_parallel_group(with_context_parallel=True)


def _tensor_keys(state: Any) -> set[str]:
    return {sh.key for sh in nested_values(state) if isinstance(sh, ShardedTensor)}


def save_checkpoint(output_dir: str, step: int, model: Any, optimizer: Any, trainer_state: dict,
                    side_files: SideFiles, extra: Callable[[str], None]) -> str:
    """Collective. ``trainer_state``: plain values (LR schedule, consumed micro-batches, ...), saved once;
    ``extra(folder)`` runs on rank 0 beside the side files (trainer_state.json)."""
    state = model.sharded_state_dict()
    saved = {**trainer_state, "layout_key": list(_layout_key()), "optimizer_format": None, "bucket_map": None}
    if optimizer is not None:
        distributed = reshard.is_distributed(optimizer)
        model_state = dict(state)
        state["optimizer"] = _optimizer_state(model_state, optimizer, is_loading=False)
        saved.update(optimizer_step=optimizer_step_count(optimizer),
                     optimizer_format=_BUCKETS if distributed else _MODEL_SPACE,
                     bucket_map=reshard.bucket_map(optimizer, model_state, _tensor_keys(state["optimizer"]))
                     if distributed else None)
    state["rng_state"] = _rng_object(_layout_key())
    state["trainer"] = saved
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), _dp_group())
    return write_folder(checkpoint_path(output_dir, step), state, side_files, extra=extra,
                        before_commit=lambda: before_commit(step), in_writer=lambda: kill_writer(step),
                        strategy=strategy)


_BUCKETS, _MODEL_SPACE = "dp_reshardable", "model_space"  # how a checkpoint holds the optimizer's state


def _optimizer_source(path: str, directory: str, saved: dict, optimizer: Any, model_state: dict,
                      layout: ParallelLayout):
    """None to load the optimizer's state as saved (Megatron's own load), else where to read it in model space."""
    reader = DistCheckpointReader(directory)
    written = saved.get("optimizer_format") or (
        _BUCKETS if any(".distributed." in key for key in reader.keys(optimizer=True)) else _MODEL_SPACE)
    distributed = reshard.is_distributed(optimizer)
    if written == _MODEL_SPACE:
        return reshard.ModelSpaceSource(reader) if distributed else None
    rows = saved.get("bucket_map")
    if distributed and reshard.bucket_map(optimizer, model_state, None) == rows:
        return None  # the same buckets (any data-parallel size)
    if rows is not None:
        return reshard.BucketSource(reader, rows)
    change = layout_change(read_layout(path), layout)
    if change is None and distributed:
        return None
    raise UserError(f"{path} was written by an earlier llamafactory_mca whose distributed-optimizer checkpoints "
                    "reload only under the layout they were written in"
                    + (f", and this run changes it ({change})" if change else
                       ", and this run turns the distributed optimizer off") + ". Resume with the checkpoint's layout "
                    f"(its {os.path.basename(path)}/mca_layout.json), or start a new run from its weights: "
                    f"model_name_or_path: {path}.")


def load_checkpoint(path: str, model: Any, optimizer: Any | None, layout: ParallelLayout) -> dict:
    """Restore model, optimizer and (same TP/PP layout) RNG states; returns the saved trainer state."""
    directory = dist_checkpoint_dir(path)
    common = dist_checkpointing.load_common_state_dict(directory)
    saved = common.get("trainer", {})
    state = model.sharded_state_dict()
    source = None
    if optimizer is not None:
        source = _optimizer_source(path, directory, saved, optimizer, dict(state), layout)
        if source is None:
            state["optimizer"] = _optimizer_state(dict(state), optimizer, is_loading=True)
    same_rng = tuple(saved.get("layout_key", ())) == _layout_key()
    if same_rng:
        state["rng_state"] = _rng_object(_layout_key())
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(directory), _dp_group())
    try:
        loaded = dist_checkpointing.load(state, directory, sharded_strategy=strategy)
    except (Exception, CheckpointException) as err:  # torch DCP's is a BaseException
        instead = newest_intact(os.path.dirname(os.path.abspath(path)), besides=path)
        raise UserError(f"loading the checkpoint {path} failed ({_root_cause(err, directory)}): its files are corrupt "
                        "or were written by an incompatible version."
                        + (f" Resume from {instead} instead (resume_from_checkpoint: {instead})." if instead else "")
                        ) from err
    for i, chunk in enumerate(model.chunks):
        chunk.load_state_dict(loaded["model" if len(model.chunks) == 1 else f"model{i}"], strict=False)
    check_finite(model.chunks, path)
    if optimizer is not None:
        if source is None:
            with torch.no_grad():  # fp32 runs: main params are the model's leaf parameters, copied into in place
                optimizer.load_state_dict(loaded["optimizer"])
        else:
            _init_optimizer_state(optimizer)
            reshard.load_model_space(optimizer, model.sharded_state_dict(), source, path)
        use_fused_adam(optimizer)
        _restore_step_count(optimizer, saved.get("optimizer_step"))
    if same_rng and "rng_state" in loaded:
        rng = loaded["rng_state"]
        random.setstate(rng["random"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])

        get_cuda_rng_tracker().set_states(rng["tracker"])
    if torch.distributed.get_rank() == 0:
        change = layout_change(read_layout(path), layout)
        if change or source is not None:
            logger.info("Resuming %s under another layout (%s): %s%s.", path, change or "optimizer placement",
                        "the optimizer's state re-laid out from model space" if source is not None
                        else "the optimizer's state read as saved",
                        "" if same_rng else "; RNG states start anew (they are kept per pipeline and tensor rank)")
    return saved


def _root_cause(err: BaseException, directory: str) -> str:
    """One line for what went wrong: the corrupt file where its structure shows one (torch DCP wraps each rank's
    failure, traceback and all, and names no file), else the error without torch's advice."""
    return describe_load_failure(err, directory)
