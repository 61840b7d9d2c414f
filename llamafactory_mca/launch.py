"""Our torchrun: under USE_MCA=1, LLaMA-Factory's launcher starts ``python -m llamafactory_mca.launch`` where it
would start ``torchrun``, with the same arguments (plugin.py swaps the command).

It runs torch's own elastic launcher in this process and adds what a user needs from it:

- the workers stop when this process dies (their watchdog sees the parent go), and this process stops its
  workers when the command that started it dies;
- a user error raised in a worker is printed once, after torchrun's shutdown, as the last thing on screen
  (workers write it to ``LLAMAFACTORY_MCA_ERROR_FILE``); a crashed worker keeps its own traceback and is
  followed by one line naming the rank and exit code, instead of torchrun's ChildFailedError report;
- torchrun's banner about OMP_NUM_THREADS gives way to a sensible default (cores / processes);
- on a machine without GPUs, the workers of a one-node run are forked from this process after it has imported
  what they import (LLaMA-Factory's tuner, transformers, Megatron-Core, our trainer: ~14 s of CPU per process),
  instead of each starting Python afresh. Eight CPU ranks on a laptop start in seconds, not a minute, and share
  those modules' memory. With GPUs the workers start as torchrun starts them: a process that has touched CUDA
  must not fork.
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
        args = parse_args(argv)
        _fork_on_cpu(args)
        run(args)
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


# What a worker imports before it trains; importing it here once lets forked workers skip it.
WORKER_IMPORTS = ("llamafactory.train.tuner", "llamafactory_mca.workflow", "llamafactory_mca.trainer.trainer")


def _fork_on_cpu(args) -> None:
    """Without GPUs and on one node, have torchrun fork its workers from this process (its ``--run-path`` with
    ``--start-method fork``) once the workers' imports are done here. A forked worker starts with this process's
    signal handlers (torch's agent turns SIGTERM into an exception) and sees its rank only after the fork:
    ``_in_forked_worker`` restores the defaults, plugin.prepare_worker quiets the other ranks."""
    import importlib

    import torch
    from torch.distributed.run import parse_min_max_nnodes

    if (args.run_path or args.module or args.no_python or torch.cuda.is_available()
            or parse_min_max_nnodes(args.nnodes)[1] != 1 or os.environ.get("LLAMAFACTORY_MCA_SPAWN") == "1"):
        return
    for name in WORKER_IMPORTS:
        importlib.import_module(name)
    for stream in (sys.stdout, sys.stderr):  # what ``python -u`` gave each worker: lines reach the screen at once
        stream.reconfigure(line_buffering=True)
    os.register_at_fork(after_in_child=_in_forked_worker)
    args.run_path, args.start_method = True, "fork"


FORKED_ENV = "LLAMAFACTORY_MCA_FORKED_WORKER"


def _in_forked_worker() -> None:
    os.environ[FORKED_ENV] = "1"
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
