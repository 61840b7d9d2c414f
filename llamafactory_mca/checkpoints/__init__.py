"""Our checkpoint folder, its one owner: what it holds, writing it, whether a folder is one, which one to resume.

A folder of ours (``output_dir/checkpoint-N`` of training, or the output of ``llamafactory-mca convert``) holds

- ``dist_ckpt/``: the Megatron dist checkpoint (model; for training also optimizer, RNG, LR schedule, consumed
  micro-batches — what goes in is ``trainer/checkpoint.py``'s business, how it is written is ``write_folder``'s);
- ``mca_config.json``: the model in Megatron terms (``models.config.McaConfig``);
- ``mca_layout.json``: the parallel layout it was written in (a load under another one reshards: the model's
  tensors are global, the optimizer's are re-laid out by ``trainer/reshard.py``);
- ``mca_run.json`` (training): what the run was (stage, finetuning type, model), so that a resume that would
  continue another kind of run is refused before any worker starts;
- Hugging Face ``config.json``, tokenizer and processor files, and for training ``trainer_state.json``.

``write_folder`` writes it all into ``tmp-<name>`` and renames it when complete, so a folder with our name is
whole. Everyone else asks this module; it imports nothing heavy at module level (the launcher asks it before any
worker starts, the merge before it writes anything).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..args import LAYOUT_KEY, LAYOUT_KEYS
from ..errors import UserError
from . import manifest, writers
from .dist_reader import DistCheckpointReader
from .hf_io import copy_side_files, write_hf_config


class ModelConfig(Protocol):
    """What a folder records of its model: ``models.config.McaConfig``, named by its fields alone (models/ sits above
    this module and reads its folders)."""

    hf_model_type: str
    transformer: dict[str, Any]
    hf_config: dict[str, Any]


PREFIX = "checkpoint"
TMP_PREFIX = "tmp-checkpoint"
DIST_DIR = "dist_ckpt"  # where a checkpoint folder keeps its Megatron dist checkpoint
MCA_CONFIG_NAME = "mca_config.json"  # the model in Megatron terms (models.config.McaConfig)
LAYOUT_NAME = "mca_layout.json"  # the layout it was written in
TRAINER_STATE_NAME = "trainer_state.json"
RUN_NAME = "mca_run.json"  # a training checkpoint's run: stage, finetuning type, model
ADAPTER_CONFIG_NAME = "adapter_config.json"  # in a LoRA run's checkpoints: what the adapters are (peft's file)
DP_KEY = "data_parallel_size"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


def config_file(folder: str) -> str:
    """The model config's file in a folder of ours (a checkpoint or a converted model): ``McaConfig.from_json_file``
    reads it."""
    return os.path.join(folder, MCA_CONFIG_NAME)


def is_ours(path: str) -> bool:
    """A folder written by us (training or convert), as opposed to a Hugging Face model folder."""
    return os.path.isfile(os.path.join(path, MCA_CONFIG_NAME))


def is_adapter_checkpoint(path: str) -> bool:
    """A checkpoint of a LoRA run: adapters only, the base model is its adapter_config's base_model_name_or_path."""
    return is_ours(path) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG_NAME))


def read_layout(path: str) -> dict[str, Any]:
    """The layout a folder was written in (``LAYOUT_KEYS`` + ``moe_grouped_gemm``), or {} when not recorded."""
    file = os.path.join(path, LAYOUT_NAME)
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def layout_record(layout: Any) -> dict[str, Any]:
    """A ``parallel.ParallelLayout`` as the layout file records it (the recipe's key names, and the dp size)."""
    return {**{key: getattr(layout, size) for size, key in LAYOUT_KEY.items()}, DP_KEY: layout.dp}


def layout_change(saved: dict[str, Any], layout: Any) -> str | None:
    """What differs between a recorded layout and ``layout``, e.g. ``tensor_model_parallel_size 1 -> 2``; None if
    nothing (or nothing was recorded)."""
    now = layout_record(layout)
    changes = [f"{key} {saved[key] or 1} -> {now[key] or 1}" for key in (*LAYOUT_KEYS, DP_KEY)
               if key in saved and (saved[key] or 1) != (now[key] or 1)]
    return ", ".join(changes) or None


@dataclasses.dataclass
class SideFiles:
    """Everything a folder of ours carries besides its dist checkpoint."""

    config: ModelConfig
    layout: Any = None  # parallel.ParallelLayout
    grouped_experts: bool | None = None
    tokenizer: Any = None
    processor: Any = None
    hf_source: str | None = None  # a Hugging Face folder to copy config.json and tokenizer files from (convert)
    adapter_config: dict | None = None  # a LoRA run's peft adapter_config.json (its checkpoints hold adapters only)
    run: dict | None = None  # training: ``run_record``

    def write(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        _write_json(os.path.join(directory, MCA_CONFIG_NAME), dataclasses.asdict(self.config))
        if self.layout is not None:
            _write_json(os.path.join(directory, LAYOUT_NAME),
                        {**layout_record(self.layout), "moe_grouped_gemm": self.grouped_experts})
        if self.hf_source is not None:
            copy_side_files(self.hf_source, directory)
            shutil.copy(os.path.join(self.hf_source, "config.json"), os.path.join(directory, "config.json"))
        else:
            write_hf_config(self.config.hf_config, directory, None)
        if self.adapter_config is not None:
            _write_json(os.path.join(directory, ADAPTER_CONFIG_NAME), self.adapter_config)
        if self.run is not None:
            _write_json(os.path.join(directory, RUN_NAME), self.run)
        for saver in (self.tokenizer, self.processor):
            if saver is not None:
                saver.save_pretrained(directory)


def write_folder(path: str, state: dict, side_files: SideFiles, *, extra: Callable[[str], None] | None = None,
                 before_commit: Callable[[], None] | None = None, in_writer: Callable[[], None] | None = None,
                 strategy: Any = None) -> str:
    """Write one folder of ours (collective): the sharded ``state`` as its dist checkpoint, then (rank 0) the side
    files and ``extra(tmp)``; everything lands in ``tmp-<name>`` first and is renamed to ``path`` only when whole.
    An existing ``path`` of ours is replaced (a rerun of the same step); anything else there is refused. A file
    writer that dies mid-save ends it on every rank with one UserError, the unfinished folder removed
    (``writers.py``); ``in_writer`` runs first in each writer process (tests' deliberate faults)."""
    path = os.path.abspath(path)
    tmp = os.path.join(os.path.dirname(path), f"tmp-{os.path.basename(path)}")
    rank = torch.distributed.get_rank()
    if rank == 0:
        if os.path.exists(path) and not is_ours(path) and os.listdir(path):
            raise UserError(f"{path} exists and is not a llamafactory_mca checkpoint; choose another folder.")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, DIST_DIR))
    _in_process_results_queue()
    writers.install()
    torch.distributed.barrier()
    try:
        _write_and_commit(path, tmp, rank, state, side_files, extra, before_commit, in_writer, strategy)
    except KeyboardInterrupt:  # Ctrl-C: the save is dropped whole; the newest complete checkpoint stays the one
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    torch.distributed.barrier()
    return path


def _write_and_commit(path: str, tmp: str, rank: int, state: dict, side_files: SideFiles,
                      extra: Callable[[str], None] | None, before_commit: Callable[[], None] | None,
                      in_writer: Callable[[], None] | None, strategy: Any) -> None:
    from megatron.core import dist_checkpointing  # here: reading or verifying a folder needs no Megatron

    try:
        with writers.watching(in_writer):
            dist_checkpointing.save(state, os.path.join(tmp, DIST_DIR), sharded_strategy=strategy)
    except CheckpointException as err:  # Megatron's finalize raises it on every rank, so all of them are here
        detail = writers.describe_failure()
        if detail is None:
            raise
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(_save_failed(path, detail)) from err
    torch.distributed.barrier()
    hashed = _hash_own_files(os.path.join(tmp, DIST_DIR), rank)
    if before_commit is not None:
        before_commit()
    if rank == 0:
        side_files.write(tmp)
        if extra is not None:
            extra(tmp)
        listed = {os.path.join(DIST_DIR, name): entry for part in hashed for name, entry in part.items()}
        rest = [name for name in manifest.files_under(tmp) if name not in listed]
        manifest.write(tmp, {**listed, **manifest.entries(tmp, rest)})
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


def _hash_own_files(dist_dir: str, rank: int) -> list[dict[str, dict]]:
    """Collective: each rank hashes the data files it wrote (``__<rank>_<n>.distcp``, still in its page cache), in
    parallel with the others; rank 0 gets every rank's entries."""
    own = [name for name in os.listdir(dist_dir) if name.startswith(f"__{rank}_")]
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, manifest.entries(dist_dir, own))
    return gathered


def _save_failed(path: str, detail: str) -> str:
    previous = newest_intact(os.path.dirname(path))
    keep = (f"{previous} is the newest complete checkpoint: resume_from_checkpoint: true continues from it" if previous
            else "no earlier checkpoint of this run exists")
    return (f"saving {os.path.basename(path)} failed: {detail}. The unfinished folder was removed and {keep}. "
            "Free memory or disk (dmesg names the out-of-memory killer) and run again.")


def _in_process_results_queue() -> None:
    """Megatron's checkpoint writer hands its results back through a queue it makes, by default, from a
    ``multiprocessing`` Manager started with ``spawn``: a helper process per rank that imports torch (seconds at the
    first save), holds ~0.6 GB, outlived a rank killed by SIGKILL, and whose death (kill -9, the out-of-memory killer)
    broke the next save. Our saves are synchronous: the results are put and read back in this process (the file
    writers it forks report through a queue of their own), so a thread-safe in-process queue does the same job with
    no process behind it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # here: as above

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def dist_checkpoint_dir(path: str) -> str | None:
    """The dist-checkpoint folder of one of our checkpoints (``path`` itself or ``path/dist_ckpt``)."""
    for candidate in (os.path.join(path, DIST_DIR), path):
        if os.path.isfile(os.path.join(candidate, "metadata.json")):
            return candidate
    return None


def is_checkpoint(path: str) -> bool:
    """Ours and finished (renamed from tmp-, with both configs); says nothing about whether its files are intact."""
    return is_ours(path) and dist_checkpoint_dir(path) is not None


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Finished ``checkpoint-N`` folders, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path) and is_checkpoint(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def verify_checkpoint(path: str) -> None:
    """Raise a UserError naming the file unless ``path`` is a complete, readable checkpoint of ours.

    Cheap (configs, metadata and data-file sizes; no tensor is read).
    """
    config_path = os.path.join(path, MCA_CONFIG_NAME)
    dist = dist_checkpoint_dir(path)
    if not os.path.isfile(config_path) or dist is None:
        raise UserError(f"{path} is not a llamafactory_mca checkpoint: it needs {MCA_CONFIG_NAME} and a Megatron dist "
                        f"checkpoint (metadata.json) in it or in its {DIST_DIR}/ folder.")
    try:
        with open(config_path, encoding="utf-8") as f:
            json.load(f)["transformer"]
    except Exception as err:
        raise UserError(f"{config_path} is truncated or corrupt ({type(err).__name__}: {err}).") from err
    DistCheckpointReader(dist).verify()


def verify_contents(path: str) -> bool:
    """The files of ``path`` against its manifest (``manifest.py``): True when they all match. A checkpoint of ours
    written before checksums gets one line saying it cannot be verified; a Hugging Face folder without a manifest (not
    written by us) is left to the header checks. A bad file raises a UserError naming it."""
    if manifest.verify(path):
        return True
    if is_ours(path):
        print(f"[llamafactory_mca] {manifest.unverifiable(path)}", file=sys.stderr, flush=True)
    return False


def newest_intact(output_dir: str, besides: str | None = None) -> str | None:
    """The newest checkpoint in ``output_dir`` that verifies, other than ``besides``."""
    for _, path in reversed(list_checkpoints(output_dir)):
        if besides is not None and os.path.abspath(path) == os.path.abspath(besides):
            continue
        try:
            verify_checkpoint(path)
        except UserError:
            continue
        return path
    return None


def run_record(stage: str, finetuning_type: str, config: ModelConfig) -> dict[str, Any]:
    """What a training run is, as its checkpoints record it (``mca_run.json``) and a resume must match."""
    t = config.transformer
    return {"stage": stage, "finetuning_type": finetuning_type, "model_type": config.hf_model_type,
            "num_layers": t.get("num_layers"), "hidden_size": t.get("hidden_size")}


def check_same_run(path: str, run: dict[str, Any]) -> None:
    """A resume continues the run that wrote ``path``: the same stage, finetuning type and model (the layout may
    change). Anything else is a new run from its weights, which says how."""
    file = os.path.join(path, RUN_NAME)
    if not os.path.isfile(file):
        return  # written before the record existed: the load itself says what does not fit
    with open(file, encoding="utf-8") as f:
        saved = json.load(f)
    if any(saved.get(k) != run.get(k) for k in ("model_type", "num_layers", "hidden_size")):
        raise UserError(f"cannot resume from {path}: it was written for {_describe_model(saved)}, and this run "
                        f"trains {_describe_model(run)}. Resume with the model it was written for, or choose another "
                        "output_dir / resume_from_checkpoint: false.")
    for key in ("stage", "finetuning_type"):
        if saved.get(key) != run.get(key):
            start = (f"merge it (llamafactory-mca merge --checkpoint_path {path} --merge_lora) and set "
                     "model_name_or_path to the merged folder" if saved.get("finetuning_type") == "lora"
                     else f"set model_name_or_path: {path}")
            raise UserError(f"cannot resume from {path}: it was written by a {key}={saved.get(key)!r} run and this "
                            f"run has {key}={run.get(key)!r}; resuming continues the same run (its optimizer state, "
                            f"schedule and data position). To start this run from its weights, {start}, with "
                            "resume_from_checkpoint: false or another output_dir.")


def _describe_model(run: dict[str, Any]) -> str:
    return f"{run.get('model_type')} ({run.get('num_layers')} layers, hidden size {run.get('hidden_size')})"


def resolve_resume(resume: Any, output_dir: str, run: dict[str, Any] | None = None) -> str | None:
    """``resume_from_checkpoint`` (a path, true/"true" for the newest complete one, None/false) as a folder that
    verifies and, given ``run`` (``run_record``), continues the same kind of run; otherwise a UserError naming the
    broken file and the checkpoint to use instead, or what differs."""
    if resume in (None, False, "", "false", "False"):
        return None
    if resume in (True, "true", "True"):
        found = list_checkpoints(output_dir)
        if not found:
            raise UserError(f"resume_from_checkpoint=true but {output_dir} holds no complete checkpoint-N folder.")
        resume = found[-1][1]
    if not os.path.isdir(resume) or not is_checkpoint(resume):
        raise UserError(f"resume_from_checkpoint={resume!r} is not a llamafactory_mca checkpoint (it needs "
                        f"{MCA_CONFIG_NAME} and {DIST_DIR}/). Give a complete output_dir/checkpoint-N folder, or "
                        "true.")
    try:
        verify_checkpoint(resume)
    except UserError as err:
        instead = newest_intact(os.path.dirname(os.path.abspath(resume)), besides=resume)
        fix = (f"Resume from the newest intact checkpoint instead: resume_from_checkpoint: {instead}" if instead
               else "No other intact checkpoint is there: set overwrite_output_dir: true to start over")
        raise UserError(f"cannot resume from {resume}: {err} {fix}.") from err
    if run is not None:
        check_same_run(resume, run)
    return resume


def rotate(output_dir: str, limit: int | None) -> None:
    """Keep the newest ``limit`` complete checkpoints (call on one rank); stale tmp- folders go too."""
    for name in os.listdir(output_dir):
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    if not limit:
        return
    found = list_checkpoints(output_dir)
    for _, path in found[: max(len(found) - limit, 0)]:
        shutil.rmtree(path, ignore_errors=True)
