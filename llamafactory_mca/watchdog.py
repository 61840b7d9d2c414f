"""No silent hangs and no orphans: a thread in every worker that ends it when

- its main thread has waited at one spot for longer than ``ddp_timeout`` without any progress, in a
  communication call (a torch.distributed collective, a Megatron pipeline send/receive, a gradient bucket's
  reduce) or, on GPUs, in a host synchronisation behind an asynchronous NCCL collective; the message names the
  rank, the step and the call, and the rank that stopped, where this node can tell (every rank on a node
  posts where it stands in the launcher's status folder);
- a checkpoint writer process it forked was killed mid-save (Megatron would wait for its result forever); or
- the launcher that started it is gone (torchrun killed with SIGKILL cannot stop its workers itself).

Every process a worker forks (the checkpoint writer's result Manager and file writers, data workers) is killed by
the kernel when the worker ends, however it ends: a worker killed with SIGKILL (the out-of-memory killer's signal)
runs no exit handler that could stop them.

``kill -USR1 <pid>`` makes a worker print every thread's stack to its stderr (``faulthandler``) and carry on: where a
rank stands, whatever it waits in.

A rank that computes for a long time is not waiting, so it is never stopped; the ranks waiting for it are,
after ``ddp_timeout``, as NCCL would, but with a message a person can act on. The process-group timeout is
set a minute longer, so this message comes first on gloo and NCCL alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import types

from .errors import LAUNCHER_PID_ENV, STATUS_DIR_ENV, report


# Where the main thread stands when it waits for other ranks.
_COMMUNICATION = ("torch/distributed/", "megatron/core/pipeline_parallel/p2p_communication.py",
                  "megatron/core/distributed/")
# writing checkpoint files is work, not a wait; torchrun's frames sit under each rank it forked (launch/torchrun.py)
_NOT_WAITING = ("torch/distributed/checkpoint/filesystem.py", "torch/distributed/run.py",
                "torch/distributed/launcher/", "torch/distributed/elastic/")
_SAVING = "dist_checkpointing/strategies/filesystem_async.py"  # waits for the writer processes it forked

_ACTIVE: Watchdog | None = None


def _is_communication(frame: types.FrameType) -> bool:
    path = frame.f_code.co_filename.replace(os.sep, "/")
    return any(m in path for m in _COMMUNICATION) and not any(m in path for m in _NOT_WAITING)


def waiting_in(frame: types.FrameType | None) -> str | None:
    """The communication call a stack is waiting in ("all_reduce, called from trainer.py:91"), or None."""
    innermost = None
    caller = None
    while frame is not None:
        if _is_communication(frame):
            innermost = innermost or frame
        elif innermost is not None:
            caller = frame
            break
        frame = frame.f_back
    if innermost is None:
        return None
    where = ""
    if caller is not None:
        where = f", called from {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno} " \
                f"({caller.f_code.co_name})"
    return f"{innermost.f_code.co_name} ({os.path.basename(innermost.f_code.co_filename)}){where}"


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, poll_s: float = 1.0) -> None:
        self.timeout_s, self.rank, self.poll_s = timeout_s, rank, poll_s
        self.step: int | None = None
        self.phase = "starting"
        self.progress = 0
        self._parent = _launcher()
        self._main = threading.main_thread().ident
        import torch

        self._gpu = torch.cuda.is_available()
        self._thread = threading.Thread(target=self._run, name="llamafactory_mca-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def _where(self) -> str:
        step = f"step {self.step}" if self.step is not None else self.phase
        return f"rank {self.rank} ({step})"

    def _run(self) -> None:
        seen, since, spot = -1, time.monotonic(), None
        while True:
            time.sleep(self.poll_s)
            if os.getppid() != self._parent:
                if os.environ.get("LOCAL_RANK", "0") == "0":
                    print(f"[llamafactory_mca] the launcher (pid {self._parent}) is gone: stopping its workers.",
                          file=sys.stderr, flush=True)
                os._exit(1)
            frame = sys._current_frames().get(self._main)
            self._post(frame)
            self._check_writers(frame)
            now = time.monotonic()
            here = (id(frame), frame.f_lasti) if frame is not None else None
            if self.progress != seen or here != spot:
                seen, since, spot = self.progress, now, here
                continue
            if now - since <= self.timeout_s:
                continue
            call = waiting_in(frame)
            others = self._others()
            if call is None and self._gpu and frame is not None:
                at = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
                ahead = [o for o in others if self.step is not None and (o.get("step") or 0) > self.step]
                if others and all((o.get("waiting") or o in ahead) and _alive(o["pid"]) for o in others):
                    # every other rank of this node is past this one's step or waits in a collective (for this one):
                    # this is the rank that stopped
                    report(f"{self._where()} has not moved for {now - since:.0f} s at {at} while "
                           f"{', '.join(o['where'] for o in others)} wait for it in collectives, longer than "
                           f"ddp_timeout={self.timeout_s:g} s: this rank is stuck (a GPU kernel that does not finish, "
                           "a deadlock, a lost GPU). Stopping the run.")
                    os._exit(1)
                # NCCL collectives are asynchronous: a hung one shows as a host sync (.item(), .cpu()) that never
                # returns, in whatever frame asked for the result.
                call = f"a GPU synchronisation at {at}, behind a collective"
            if call is None:
                continue  # computing, not waiting for another rank
            culprits = _culprits(others, self.poll_s) or "another rank stopped, crashed or is stuck"
            report(f"{self._where()} waited {now - since:.0f} s in {call}, longer than ddp_timeout="
                   f"{self.timeout_s:g} s: {culprits}. Stopping the run. (Raise ddp_timeout if a rank legitimately "
                   "needs longer, e.g. to tokenize a large dataset.)")
            os._exit(1)

    # ---- where every rank of this node stands ----------------------------------------------------------------------
    def _post(self, frame: types.FrameType | None) -> None:
        """Write where this rank stands into the launcher's status folder (once per poll)."""
        folder = os.environ.get(STATUS_DIR_ENV)
        if not folder or frame is None:
            return
        at = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
        status = {"rank": self.rank, "pid": os.getpid(), "where": self._where(), "step": self.step,
                  "time": time.time(), "waiting": waiting_in(frame), "at": at}
        path = os.path.join(folder, f"rank-{self.rank}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(status, f)
            os.replace(path + ".tmp", path)
        except OSError:
            pass

    def _others(self) -> list[dict]:
        """Where the other ranks of this node last said they stand (empty without the launcher's status folder)."""
        folder = os.environ.get(STATUS_DIR_ENV)
        if not folder or not os.path.isdir(folder):
            return []
        found = []
        for name in sorted(os.listdir(folder)):
            if not (name.startswith("rank-") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(folder, name)) as f:
                    status = json.load(f)
            except (OSError, ValueError):
                continue
            if status.get("rank") != self.rank:
                found.append(status)
        return found

    def _check_writers(self, frame: types.FrameType | None) -> None:
        """Megatron's checkpoint save waits for the writer processes it forked with no timeout: one killed mid-save
        (e.g. by the out-of-memory killer) would stop the run forever."""
        if frame is None or not any(_SAVING in f.f_code.co_filename.replace(os.sep, "/") for f in _stack(frame)):
            return
        for child in list(multiprocessing.process._children):  # started by this process, not yet joined
            code = child.exitcode
            if code is not None and code < 0:
                report(f"{self._where()}: a checkpoint writer process (pid {child.pid}) was killed by "
                       f"{signal.Signals(-code).name} while saving; the checkpoint being written is incomplete (its "
                       "tmp- folder is ignored on resume). Stopping the run; resume from the newest complete "
                       "checkpoint. (Out of host memory? The writers hold each rank's tensors while writing.)")
                os._exit(1)


def _launcher() -> int:
    """The process whose end ends this worker. Our launcher names itself: a worker whose launcher was killed before
    this thread started has been handed to another parent already, and would otherwise take that one for its
    launcher and wait in its start-up (for a rendezvous store that died with the launcher) forever. Under a bare
    torchrun, the parent."""
    pid = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(pid) if pid.isdigit() else os.getppid()


def _culprits(others: list[dict], poll_s: float) -> str | None:
    """The other ranks that are not waiting for anyone: gone, frozen, or busy outside any collective."""
    found = []
    for status in others:
        if not _alive(status["pid"]):
            found.append(f"{status['where']} is gone (pid {status['pid']})")
        elif time.time() - status["time"] > 5 * poll_s + 5:
            found.append(f"{status['where']} stopped responding at {status['at']}")
        elif not status.get("waiting"):
            found.append(f"{status['where']} is not in a collective: it stands at {status['at']}")
    return "; ".join(found) or None


def _stack(frame: types.FrameType | None):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- forked children die with their worker ------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1
_forking_parent = 0


def _remember_parent() -> None:
    global _forking_parent
    _forking_parent = os.getpid()


def _die_with_parent() -> None:
    """In a child just forked by a worker: the kernel sends it SIGKILL when the worker ends (Linux)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _forking_parent:  # the worker ended before the line above
        os._exit(1)


def children_die_with_worker() -> None:
    """Every process this worker forks from now on ends when the worker ends, by whatever signal (Linux's
    parent-death signal, set in the child right after the fork; elsewhere nothing changes)."""
    if sys.platform.startswith("linux"):
        os.register_at_fork(before=_remember_parent, after_in_child=_die_with_parent)


def start(timeout_s: float, rank: int) -> Watchdog:
    global _ACTIVE
    if _ACTIVE is None:
        children_die_with_worker()
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        _ACTIVE = Watchdog(timeout_s, rank).start()
    return _ACTIVE


def beat(step: int | None = None, phase: str | None = None) -> None:
    """Progress was made (a micro-batch, a step, a save); optionally the step or phase now running."""
    if _ACTIVE is None:
        return
    _ACTIVE.progress += 1
    if step is not None:
        _ACTIVE.step = step
    if phase is not None:
        _ACTIVE.phase = phase
