"""Our torchrun: under USE_MCA=1, LLaMA-Factory's launcher starts ``python -m llamafactory_mca.launch`` where it
would start ``torchrun``, with the same arguments (plugin.py swaps the command).

It runs torch's own elastic launcher in this process and adds what a user needs from it:

- the workers stop when this process dies (their watchdog sees the parent go), and this process stops its
  workers when the command that started it dies;
- a user error raised in a worker is printed once, after torchrun's shutdown, as the last thing on screen
  (workers write it to ``LLAMAFACTORY_MCA_ERROR_FILE``); a crashed worker keeps its own traceback and is
  followed by one line naming the rank and exit code, instead of torchrun's ChildFailedError report;
- torchrun's banner about OMP_NUM_THREADS gives way to a sensible default (cores / processes).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import time

from .errors import ERROR_FILE_ENV, PREFIX


def _watch_parent(parent: int) -> None:
    """SIGTERM ourselves when the command that started us is gone: torch's agent then stops the workers."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _nproc(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg.startswith(("--nproc_per_node", "--nproc-per-node")):
            value = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            return int(value) if value.isdigit() else 1
    return 1


def _failure_line(err) -> str:
    parts = []
    for rank, failure in sorted(err.failures.items()):
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        parts.append(f"rank {rank} ({how})")
    return (f"{PREFIX}training failed: {', '.join(parts)}. The worker's traceback is above; "
            "LLAMAFACTORY_MCA_DEBUG=1 shows torchrun's full report.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .errors import debug_enabled
    from .quiet import quiet_third_party

    quiet_third_party()
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(_nproc(argv), 1)))
    if os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS") == "1" and _torch_at_least(2, 11):
        # LLaMA-Factory's launcher sets it; torch 2.11+ does this by default and warns on every rank that it is set
        del os.environ["TORCH_NCCL_AVOID_RECORD_STREAMS"]
    fd, error_file = tempfile.mkstemp(prefix="llamafactory_mca-", suffix=".err")
    os.close(fd)
    os.remove(error_file)  # workers create it exclusively: the first one to fail wins
    os.environ[ERROR_FILE_ENV] = error_file
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    # torch's elastic loggers take their level from LOGLEVEL when created; ours replace their failure report.
    saved = os.environ.get("LOGLEVEL")
    if not debug_enabled():
        os.environ["LOGLEVEL"] = "CRITICAL"
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if saved is None:
        os.environ.pop("LOGLEVEL", None)
    else:
        os.environ["LOGLEVEL"] = saved
    if not debug_enabled():  # modules that use plain logging.getLogger inherit from here
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
        return 0
    except ChildFailedError as err:
        message = _read(error_file)
        print(message or _failure_line(err), file=sys.stderr, flush=True)
        return 1
    except SignalException as err:
        print(f"{PREFIX}stopped by {err.sigval.name}; the workers were stopped too.", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    finally:
        if os.path.exists(error_file):
            os.remove(error_file)


def _torch_at_least(major: int, minor: int) -> bool:
    import importlib.metadata
    import re

    match = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torch"))
    return bool(match) and (int(match.group(1)), int(match.group(2))) >= (major, minor)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
