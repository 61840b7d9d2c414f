"""Our torchrun: under USE_MCA=1, where LLaMA-Factory's launcher would start ``torchrun`` it calls :func:`main` with
the same arguments, in the launching process (plugin.py swaps the command): that process has imported torch,
transformers, LLaMA-Factory's arguments and Megatron-Core for its checks already, and a second interpreter would
import them again before the first worker starts. ``python -m llamafactory_mca.launch.torchrun`` is the same for a
command of its own (``convert``).

It runs torch's own elastic launcher and adds what a user needs from it:

- the workers stop when this process dies (their watchdog sees the parent go); run as a command of its own, this
  process stops its workers when the command that started it dies;
- a user error raised in a worker is printed once, after torchrun's shutdown, as the last thing on screen
  (workers write it to ``LLAMAFACTORY_MCA_ERROR_FILE``); a crashed worker keeps its own traceback and is
  followed by one line naming the rank and exit code (or the signal that killed it, which leaves no traceback),
  instead of torchrun's ChildFailedError report;
- the workers post where they stand in a status folder of this run, so a rank that waits past ``ddp_timeout`` can
  name the rank it waits for (``watchdog.py``);
- torchrun's banner about OMP_NUM_THREADS gives way to a sensible default (cores / processes);
- the ranks are forked from this process once it has imported what they run (:func:`_forked_rank`): a rank spends
  ~10 s of CPU importing torch, transformers, LLaMA-Factory and Megatron-Core (16-19 s on a GPU host), which for 8
  ranks on a 2-core machine was most of a short run, and on a GPU the largest part of the time to the first step.
  A forked child can use CUDA only if this process never initialised CUDA's driver, so a launcher asks torch about
  GPUs through NVML (:func:`keep_cuda_for_workers`, at interpreter start) and the driver is asked before forking;
  where it was initialised after all, or for ``-m`` (convert), ranks are spawned as torchrun spawns them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid

from .. import start_clock
from ..errors import ERROR_FILE_ENV, LAUNCHER_PID_ENV, PREFIX, STATUS_DIR_ENV, debug_enabled
from ..quiet import quiet_third_party
from .interrupts import SwallowedSignals


NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch's: its CUDA checks through NVML, without cuInit
SPAWN_ENV = "LLAMAFACTORY_MCA_SPAWN_RANKS"  # 1: spawn the ranks, as torchrun does, even where they could be forked
CUDA_ERROR_NOT_INITIALIZED = 3


def keep_cuda_for_workers() -> None:
    """At a launcher's interpreter start: torch.cuda.is_available() (LLaMA-Factory's launcher, transformers, ours)
    asks NVML instead of initialising CUDA's driver here, so the workers can be forked (:func:`_forks_ranks`)."""
    os.environ.setdefault(NVML_CHECK_ENV, "1")


def cuda_driver_untouched() -> bool:
    """Whether this process has not initialised CUDA's driver: ``cuDeviceGetCount`` answers
    CUDA_ERROR_NOT_INITIALIZED until ``cuInit`` ran (torch's first use, or a plain is_available()). True without a
    driver (a CPU machine)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return driver.cuDeviceGetCount(ctypes.byref(ctypes.c_int())) == CUDA_ERROR_NOT_INITIALIZED


def _nvml_compute_capability() -> tuple[int, int] | None:
    """The lowest CUDA compute capability among this node's GPUs, from NVML (which does not initialise CUDA)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count, found = ctypes.c_uint(), []
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 or
                    nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
                return None
            found.append((major.value, minor.value))
        return min(found) if found else None
    finally:
        nvml.nvmlShutdown()


@contextlib.contextmanager
def bf16_answered_by_nvml():
    """LLaMA-Factory's ``extras/misc.py`` asks at import whether the GPU has bf16 (transformers'
    is_torch_bf16_gpu_available -> torch.cuda.is_bf16_supported, which initialises CUDA), so every launcher that
    imports it could only spawn its ranks. While it imports, a GPU of compute capability 8.0 or more (what torch
    checks) answers yes from NVML; anything else asks torch."""
    import torch  # here: this module loads at every interpreter start under USE_MCA

    real = torch.cuda.is_bf16_supported

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        capability = None if torch.cuda.is_initialized() else _nvml_compute_capability()
        return True if capability and capability >= (8, 0) else real(including_emulation)

    torch.cuda.is_bf16_supported = is_bf16_supported
    try:
        yield
    finally:
        torch.cuda.is_bf16_supported = real


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


_KILLED_HOW = {"SIGKILL": "killed by SIGKILL (the out-of-memory killer's signal, or kill -9)",
               "SIGSEGV": "crashed with SIGSEGV (a segmentation fault in native code)",
               "SIGABRT": "aborted (SIGABRT, from native code)"}


def _failure_line(err, world: int) -> str:
    """One line for workers that ended without a user error: the first to fail (torchrun stops the others with
    SIGTERM, which is not news), how it ended, and where to look. Spawned ranks are reported all together; forked
    ones one at a time, so for them the others are the rest of the node's ``world`` ranks (0 when spawned)."""
    first_rank, first = min(err.failures.items(),
                            key=lambda item: (item[1].signal_name() == "SIGTERM", item[1].timestamp, item[0]))
    if first.exitcode < 0:
        name = first.signal_name()
        how = _KILLED_HOW.get(name, f"stopped by {name}")
        look = "A signal leaves no traceback; the system log (dmesg, journalctl -k) names the out-of-memory killer."
    else:
        how, look = f"exited with code {first.exitcode}", "Its traceback is above."
    ranks = set(err.failures) | set(range(world))
    others = sorted(rank for rank in ranks if rank != first_rank)
    stopped = (f" Rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} "
               f"{'were' if len(others) > 1 else 'was'} stopped with it." if others else "")
    return (f"{PREFIX}training failed: rank {first_rank} {how}.{stopped} {look} LLAMAFACTORY_MCA_DEBUG=1 shows "
            "torchrun's full report.")


def _stop_before_workers(signum, frame) -> None:
    """Ctrl-C while this process imports torch's launcher (seconds): one line, not an import's traceback."""
    print(f"{PREFIX}stopped by SIGINT before the workers started.", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)  # nothing made yet: the run folder comes after these imports


def main(argv: list[str] | None = None, in_launcher: bool = False) -> int:
    """torchrun's arguments; ``in_launcher``: called by the launching process, whose exit handlers (the output_dir
    lock's release) must run however the run ends, and which has no parent to watch."""
    argv = list(sys.argv[1:] if argv is None else argv)
    keep_cuda_for_workers()  # a launcher set it at its start already; a command of its own asks nothing before this
    if not in_launcher:
        signal.signal(signal.SIGINT, _stop_before_workers)
    quiet_third_party()
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(_nproc(argv), 1)))
    if os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS") == "1" and _torch_at_least(2, 11):
        # LLaMA-Factory's launcher sets it; torch 2.11+ does this by default and warns on every rank that it is set
        del os.environ["TORCH_NCCL_AVOID_RECORD_STREAMS"]
    if not in_launcher:
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    # torch's elastic loggers take their level from LOGLEVEL when created; ours replace their failure report.
    saved = os.environ.get("LOGLEVEL")
    if not debug_enabled():
        os.environ["LOGLEVEL"] = "CRITICAL"
    from torch.distributed.elastic.multiprocessing.api import SignalException  # here: after LOGLEVEL is set
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args

    if saved is None:
        os.environ.pop("LOGLEVEL", None)
    else:
        os.environ["LOGLEVEL"] = saved
    if not debug_enabled():
        _quiet_elastic_loggers()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # handled below from here on
    run_dir = tempfile.mkdtemp(prefix="llamafactory_mca-")
    error_file = os.path.join(run_dir, "error")  # workers create it exclusively: the first one to fail wins
    os.environ[ERROR_FILE_ENV] = error_file
    os.environ[STATUS_DIR_ENV] = run_dir
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    swallowed = SwallowedSignals(SignalException)
    try:
        args = parse_args(argv)
        forked = _forks_ranks(args)
        if forked:
            start_clock.mark(start_clock.IMPORTED)
        if debug_enabled():
            how = "forked from" if forked else "spawned by"
            print(f"[llamafactory_mca] ranks {how} the launcher", file=sys.stderr, flush=True)
        with swallowed:
            _launch(args, forked)
        return 0
    except ChildFailedError as err:
        if swallowed.signum is not None:  # sent again, but a rank it reached ended first
            return _stopped_by(signal.Signals(swallowed.signum))
        message = _read(error_file)
        print(message or _failure_line(err, _nproc(argv) if forked else 0), file=sys.stderr, flush=True)
        return 1
    except PortTaken as err:
        print(f"{PREFIX}port {err} (MASTER_PORT) is in use by another process: set MASTER_PORT to a free port, or "
              "unset it on a single node and a free one is chosen.", file=sys.stderr, flush=True)
        return 1
    except SignalException as err:
        return _stopped_by(err.sigval)
    except KeyboardInterrupt:  # Ctrl-C while this process imports what the ranks will run
        print(f"{PREFIX}stopped by SIGINT before the workers started.", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        os.environ.pop(LAUNCHER_PID_ENV, None)  # a run in this process later, without a launcher, has none


def _stopped_by(signum: signal.Signals) -> int:
    print(f"{PREFIX}stopped by {signum.name}; the workers were stopped too.", file=sys.stderr, flush=True)
    return 128 + int(signum)


def _quiet_elastic_loggers() -> None:
    """torch's elastic loggers, made before LOGLEVEL was set above (the launcher's imports may have made them), and
    those that use plain logging.getLogger, which inherit from their parent."""
    prefix = "torch.distributed.elastic"
    for name in [prefix, *(n for n in logging.root.manager.loggerDict if n.startswith(prefix + "."))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _forks_ranks(args) -> bool:
    """For a script file (what a forked rank runs) while CUDA's driver is untouched here, after importing what the
    ranks run (an import may touch it: then they are spawned); spawned for ``-m`` (convert)."""
    if args.module or args.no_python or os.environ.get(SPAWN_ENV) == "1" or not cuda_driver_untouched():
        return False
    for module in PRELOAD:
        importlib.import_module(module)
    return cuda_driver_untouched()


PORT_TRIES = 5


class PortTaken(Exception):
    """The rendezvous port is taken and is not ours to change: a user's MASTER_PORT, or a run over several nodes."""


def _launch(args, forked: bool) -> None:
    """Start the workers. LLaMA-Factory's launcher picks a free port (when MASTER_PORT is unset) and lets it go
    before torchrun listens on it, so a run starting at the same moment can take it in between: torch's static
    rendezvous then fails with EADDRINUSE, before any worker starts, and a single-node run tries a new free port."""
    from torch.distributed import DistNetworkError  # here: torch loads at start-up otherwise

    for attempt in range(PORT_TRIES):
        try:
            return _launch_once(args, forked)
        except DistNetworkError as err:
            if "EADDRINUSE" not in str(err) and "already in use" not in str(err):
                raise
            if "MASTER_PORT" in os.environ or str(args.nnodes) not in ("1", "1:1") or attempt + 1 == PORT_TRIES:
                raise PortTaken(args.master_port) from None
            args.master_port = _free_port()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _launch_once(args, forked: bool) -> None:
    from torch.distributed.launcher.api import elastic_launch  # here: torch loads at start-up otherwise
    from torch.distributed.run import config_from_args, run

    if not forked:
        run(args)
        return
    # torch's run() adds these rendezvous defaults before it launches (a command line without --master_port, as
    # convert's; LLaMA-Factory's launcher passes one)
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.run_path, args.start_method = True, "fork"
    if not _QUIET_FORKS:
        os.register_at_fork(after_in_child=_quiet_until_ranked)
        _QUIET_FORKS.append(True)
    config, _, script_and_args = config_from_args(args)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or a rank would inherit, and print again, what is still buffered here
    elastic_launch(config=config, entrypoint=_forked_rank)(*script_and_args)


_QUIET_FORKS: list[bool] = []  # the fork hook below, registered once per process


def _quiet_until_ranked() -> None:
    """In a forked rank from its first instruction until ``_forked_rank`` sets its own handlers: a signal (Ctrl-C to
    the terminal's process group, the launcher's death through torch's pdeathsig) ends it without a word, as the
    launcher says what happened. The agent's handler it inherits would raise torch's SignalException, whose traceback
    multiprocessing's bootstrap prints (seen in CI: Ctrl-C as the ranks were forked). Processes a rank forks in turn
    (its checkpoint writers, data workers) inherit the hook and are left as they were."""
    if str(os.getppid()) != os.environ.get(LAUNCHER_PID_ENV):
        return
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), _leave_quietly)


def _leave_quietly(signum, frame) -> None:
    os._exit(128 + signum)


def _wait_for_all_forked() -> None:
    """Return once every local rank of this start of the workers has been forked.

    The ranks connect to the launcher's rendezvous store only after that: the store's server thread, in the launcher,
    looks up each new connection's address (getnameinfo, under glibc's resolver lock), and a rank forked while it did
    inherits the lock taken and hangs at its own first lookup, connecting to the store. Markers in the run's folder,
    one per rank and start (a restarted group forks again), rather than a barrier a killed rank would leave broken.
    """
    folder = os.path.join(os.environ[STATUS_DIR_ENV], f"forked-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, os.environ.get("LOCAL_RANK", "0")), "w").close()
    ranks, parent = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), os.getppid()
    while len(os.listdir(folder)) < ranks:
        if os.getppid() != parent:  # the launcher is gone
            os._exit(1)
        time.sleep(0.01)


# What a rank imports before its first step: LLaMA-Factory's training entry (transformers, peft, trl, datasets) and
# ours (Megatron-Core, the trainer, the models).
PRELOAD = ("llamafactory.train.tuner", "llamafactory_mca.workflow", "llamafactory_mca.trainer.trainer",
           "llamafactory_mca.models.auto")


def _forked_rank(script: str, *script_args: str) -> None:
    """A forked rank, made like a spawned one: the default signal handlers (torch's agent set its own before the
    fork; Ctrl-C raises once, as in every worker), line-buffered output (``python -u`` for a spawned rank), only
    rank 0 speaking (set at interpreter start for a spawned one), its traceback on screen when it crashes
    (torch.multiprocessing would only hand it to the agent, whose report we replace), and a way out that returns to
    torch's agent, which waits for the return."""
    # imported by the preload already; kept here, as this module imports nothing heavy at its top (see main)
    import torch
    from torch.distributed.run import run_script_path

    from .. import parallel
    from .plugin import quiet_worker

    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    # the GPUs NVML sees must answer CUDA's own count here: a driver the launcher initialised after all answers none
    if torch.cuda.device_count() > 0 and torch._C._cuda_getDeviceCount() == 0:
        print(f"{PREFIX}rank {os.environ.get('RANK', '?')}, forked from the launcher, cannot use CUDA. Set "
              f"{SPAWN_ENV}=1 to start the ranks as separate processes.", file=sys.stderr, flush=True)
        raise SystemExit(1)
    parallel.interrupt_once()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # the process forking us imported torch before main set it
    whole_lines()
    quiet_worker()
    parallel.leave_by_returning()
    try:
        _wait_for_all_forked()
        run_script_path(script, *script_args)
    except KeyboardInterrupt:  # before the run's own handling (workflow._run): the agent says it in one line
        raise SystemExit(128 + signal.SIGINT) from None
    except Exception:
        traceback.print_exc()
        raise


def whole_lines() -> None:
    """A rank's stdout and stderr go out a line at a time, each line in one write. Written through (Python's
    unbuffered mode), ``print`` writes its text and then its newline: a rank stopped between the two (torchrun's
    SIGTERM, kill -9) left half a step line in the log, and the launcher's last line joined it."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)


def _torch_at_least(major: int, minor: int) -> bool:
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
