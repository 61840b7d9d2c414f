"""``llamafactory-mca verify PATH [PATH ...]``: is a folder intact, before a merge, a resume or a copy elsewhere.

A checkpoint of ours: its configs and dist-checkpoint metadata against its data files, then every file against the
checksums written with it. A run's output_dir: each complete checkpoint-N in it, and the exported weights beside them.
A Hugging Face folder: each safetensors header against its file and the index against the files, and the checksums
where we exported it. One line per folder; the first bad file ends the command with its name (exit 1).
"""

from __future__ import annotations

import os

from ..checkpoints import is_ours, list_checkpoints, manifest, verify_checkpoint
from ..checkpoints.hf_io import check_safetensors_files
from ..errors import UserError, user_errors
from . import flags


def verify(path: str) -> list[str]:
    """One line per folder checked (``path`` and, for an output_dir, its checkpoints); raises UserError."""
    if not os.path.isdir(path):
        raise UserError(f"{path} is not a folder: give a checkpoint, a run's output_dir or a Hugging Face model "
                        "folder.")
    lines = []
    for _, checkpoint in list_checkpoints(path):
        lines += verify(checkpoint)
    has_weights = any(n.endswith(".safetensors") for n in os.listdir(path))
    if is_ours(path):
        verify_checkpoint(path)
        what = "checkpoint of ours"
    elif has_weights:
        check_safetensors_files(path)
        what = "Hugging Face weights (headers and index checked)"
    elif lines:
        return lines
    else:
        raise UserError(f"{path} holds neither a checkpoint of ours nor safetensors weights.")
    if manifest.verify(path):
        count = len(manifest.listed(path) or {})
        lines.append(f"{path}: {what}, ok: every file listed in {manifest.MANIFEST_NAME} matches its {manifest.HASH} "
                     f"checksum ({count} files)")
    else:
        lines.append(f"{path}: {what}, structure ok; no {manifest.MANIFEST_NAME}, so the contents cannot be verified")
    return lines


def main(argv: list[str]) -> int:
    args = flags.verify().parse_args(argv)
    with user_errors():
        for path in args.paths:
            for line in verify(path):
                print(line, flush=True)
    return 0
