"""The checkpoint folder: its names, which folders are complete checkpoints of ours, and which one to resume.

``output_dir/checkpoint-N/`` holds ``dist_ckpt/`` (Megatron dist checkpoint), ``mca_config.json`` and side
files; it is written as ``tmp-checkpoint-N`` and renamed when complete (``trainer/checkpoint.py``). This module
imports nothing heavy: the launcher asks it before any worker starts, the merge before it writes anything.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .errors import UserError

PREFIX = "checkpoint"
TMP_PREFIX = "tmp-checkpoint"
DIST_DIR = "dist_ckpt"  # where a checkpoint folder keeps its Megatron dist checkpoint
MCA_CONFIG_NAME = "mca_config.json"  # the model in Megatron terms (models.config.McaConfig)
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")


def dist_checkpoint_dir(path: str) -> str | None:
    """The dist-checkpoint folder of one of our checkpoints (``path`` itself or ``path/dist_ckpt``)."""
    for candidate in (os.path.join(path, DIST_DIR), path):
        if os.path.isfile(os.path.join(candidate, "metadata.json")):
            return candidate
    return None


def is_checkpoint(path: str) -> bool:
    """Ours and finished (renamed from tmp-, with both configs); says nothing about whether its files are intact."""
    return os.path.isfile(os.path.join(path, MCA_CONFIG_NAME)) and dist_checkpoint_dir(path) is not None


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
    import json

    from .models.dist_reader import DistCheckpointReader

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


def resolve_resume(resume: Any, output_dir: str) -> str | None:
    """``resume_from_checkpoint`` (a path, true/"true" for the newest complete one, None/false) as a folder that
    verifies; otherwise a UserError naming the broken file and the checkpoint to use instead."""
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
    return resume
