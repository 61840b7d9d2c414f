"""Per-file checksums of the folders we write (``mca_manifest.json``), so that a flipped byte is named, not trained.

A size check cannot see bytes changed in place, and Megatron's and safetensors' readers take any bytes as weights: 64
flipped bytes in a ``.distcp`` merged into wrong weights without a word. So every folder we write lists its files with
their size and XXH3-128 digest (xxHash, a dependency of ``datasets`` already; about 8 GB/s on one core, so hashing
costs what reading the files back from the page cache costs). A checkpoint's files are hashed where they were written
(each rank its own dist-checkpoint files right after the save, rank 0 the rest, see ``write_folder``); an export's
(merge, ``save_hf_model``, the final weights) by the process that wrote it, its weight files and their index.

Reading verifies the same way, with threads over the files, before anything is loaded: the first file in name order
that is missing, of another size or another digest is named. Folders written before the manifest existed have none:
``verify`` says so (False) and the caller prints one line that they cannot be verified.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import xxhash

from ..errors import UserError


MANIFEST_NAME = "mca_manifest.json"
HASH = "xxh3_128"
_CHUNK = 16 << 20
_THREADS = min(16, os.cpu_count() or 1)


def file_entry(path: str) -> dict:
    """Size and digest of one file, read in chunks (xxhash releases the GIL on each, so threads run in parallel)."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"size": os.path.getsize(path), HASH: digest.hexdigest()}


def entries(folder: str, names: Iterable[str]) -> dict[str, dict]:
    """``{name: entry}`` for files of ``folder`` given by their paths relative to it."""
    names = sorted(names)
    with ThreadPoolExecutor(_THREADS) as pool:
        found = pool.map(lambda name: file_entry(os.path.join(folder, name)), names)
        return dict(zip(names, found))


def files_under(folder: str) -> list[str]:
    """Every file below ``folder`` (relative paths), but the manifest itself."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST_NAME:
                found.append(rel)
    return sorted(found)


def write(folder: str, listed: dict[str, dict]) -> None:
    """The manifest of ``folder``, written last and atomically (a folder without one is unverifiable, not wrong)."""
    tmp = os.path.join(folder, f".{MANIFEST_NAME}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"hash": HASH, "files": listed}, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(folder, MANIFEST_NAME))


def write_for(folder: str, names: Iterable[str] | None = None) -> None:
    """Hash ``names`` (default: every file below ``folder``) and write the manifest."""
    write(folder, entries(folder, files_under(folder) if names is None else names))


def listed(folder: str) -> dict[str, dict] | None:
    """The files the manifest of ``folder`` lists, or None without one."""
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is truncated or corrupt ({type(err).__name__}: {err}): the folder's files cannot "
                        "be checked against it.") from err


def verify(folder: str) -> bool:
    """Every file the manifest of ``folder`` lists is there, of its size and digest: True. No manifest: False (a
    folder written before checksums). Otherwise a UserError naming the first bad file."""
    listed_files = listed(folder)
    if listed_files is None:
        return False
    return _check(folder, listed_files)


def _check(folder: str, listed: dict[str, dict]) -> bool:
    names = sorted(listed)
    for name in names:  # the cheap failures first, in name order
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            raise UserError(f"{file} is missing: {MANIFEST_NAME} lists it.")
        if os.path.getsize(file) != listed[name]["size"]:
            raise UserError(f"{file} is truncated or was replaced: {os.path.getsize(file):,} bytes, written as "
                            f"{listed[name]['size']:,}.")
    found = entries(folder, names)
    for name in names:
        if found[name][HASH] != listed[name][HASH]:
            raise UserError(f"{os.path.join(folder, name)} is corrupt: its content differs from what was written "
                            f"({HASH} {found[name][HASH]}, written as {listed[name][HASH]}; same size).")
    return True


def unverifiable(folder: str) -> str:
    return (f"{folder} has no {MANIFEST_NAME} (written before checkpoints carried checksums): its files cannot be "
            "verified.")
