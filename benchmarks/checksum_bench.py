"""What the checkpoints' checksums cost (``llamafactory_mca/checkpoints/manifest.py``): writing a folder of files the
size of a checkpoint's, hashing them right after (as each rank does after a save, the files still in the page cache)
and verifying them with the page cache dropped where we may (as a resume or a merge reads them), beside plain reads of
the same files. Writes ``checksum.json`` and ``checksum.md`` to ``--out``.

    python benchmarks/checksum_bench.py --gib 8 --files 8 --out benchmarks/results/checksum_cpu

A 30B-parameter checkpoint of ours (bf16 weights, fp32 masters and two Adam moments) is about 14 bytes per parameter,
420 GB: the rates here say how long it takes on this disk and CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llamafactory_mca.checkpoints import manifest  # noqa: E402


CHUNK = 64 << 20


def _drop_caches() -> bool:
    """Drop the page cache (root on Linux); False where we may not, so the read is from memory."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _write(folder: str, files: int, size: int) -> list[str]:
    block = os.urandom(CHUNK)
    names = []
    for i in range(files):
        name = f"__{i}_0.distcp"
        with open(os.path.join(folder, name), "wb") as f:
            for _ in range(size // CHUNK):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        names.append(name)
    return names


def _read(folder: str, names: list[str]) -> None:
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(CHUNK):
                pass


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="total size of the files")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "checksum_bench"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    size = int(args.gib * 2**30 / args.files) // CHUNK * CHUNK
    total = size * args.files
    result = {"machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}", "files": args.files,
              "bytes": total, "hash": manifest.HASH, "threads": manifest._THREADS}
    names = []
    result["write_s"] = _timed(lambda: names.extend(_write(args.work, args.files, size)))
    result["hash_after_write_s"] = _timed(lambda: manifest.write(args.work, manifest.entries(args.work, names)))
    result["page_cache_dropped"] = _drop_caches()
    result["read_s"] = _timed(lambda: _read(args.work, names))
    result["page_cache_dropped"] &= _drop_caches()
    result["verify_s"] = _timed(lambda: manifest.verify(args.work))
    for key in ("write", "hash_after_write", "read", "verify"):
        result[f"{key}_gb_per_s"] = round(total / result[f"{key}_s"] / 1e9, 2)
    result["checkpoint_30b_verify_minutes"] = round(420e9 / (result["verify_gb_per_s"] * 1e9) / 60, 1)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "checksum.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Checksums ({manifest.HASH}): {result['machine']}", "",
             f"{args.files} files, {total / 1e9:.1f} GB; hashing with {result['threads']} threads; page cache dropped "
             f"before the read and the verify: {result['page_cache_dropped']}", "",
             "| step | seconds | GB/s |", "|---|---|---|"]
    for key, label in (("write", "write (fsync)"), ("hash_after_write", "hash after the write (the save's cost)"),
                       ("read", "plain read"), ("verify", "verify (a resume's or merge's cost)")):
        lines.append(f"| {label} | {result[f'{key}_s']:.2f} | {result[f'{key}_gb_per_s']} |")
    lines += ["", f"At this verify rate a 30B checkpoint (420 GB) takes {result['checkpoint_30b_verify_minutes']} "
              "minutes to check."]
    with open(os.path.join(args.out, "checksum.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
