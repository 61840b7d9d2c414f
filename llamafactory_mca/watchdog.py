"""No silent hangs and no orphans: a thread in every worker that ends it when

- its main thread has waited at one spot for longer than ``ddp_timeout`` without any progress, in a
  communication call (a torch.distributed collective, a Megatron pipeline send/receive, a gradient bucket's
  reduce) or, on GPUs, in a host synchronisation behind an asynchronous NCCL collective; the message names the
  rank, the step and the call; or
- the launcher that started it is gone (torchrun killed with SIGKILL cannot stop its workers itself).

A rank that computes for a long time is not waiting, so it is never stopped; the ranks waiting for it are,
after ``ddp_timeout``, as NCCL would, but with a message a person can act on. The process-group timeout is
set a minute longer, so this message comes first on gloo and NCCL alike.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types

from .errors import report

# Where the main thread stands when it waits for other ranks.
_COMMUNICATION = ("torch/distributed/", "megatron/core/pipeline_parallel/p2p_communication.py",
                  "megatron/core/distributed/")
_NOT_WAITING = ("torch/distributed/checkpoint/filesystem.py",)  # writing checkpoint files is work, not a wait

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
        self._parent = os.getppid()
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
            now = time.monotonic()
            here = (id(frame), frame.f_lasti) if frame is not None else None
            if self.progress != seen or here != spot:
                seen, since, spot = self.progress, now, here
                continue
            if now - since <= self.timeout_s:
                continue
            call = waiting_in(frame)
            if call is None and self._gpu and frame is not None:
                # NCCL collectives are asynchronous: a hung one shows as a host sync (.item(), .cpu()) that never
                # returns, in whatever frame asked for the result.
                call = (f"a GPU synchronisation at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} "
                        f"({frame.f_code.co_name}), behind a collective")
            if call is None:
                continue  # computing, not waiting for another rank
            report(f"{self._where()} waited {now - since:.0f} s in {call}, longer than ddp_timeout="
                   f"{self.timeout_s:g} s: another rank stopped, crashed or is stuck. Stopping the run. (Raise "
                   "ddp_timeout if a rank legitimately needs longer, e.g. to tokenize a large dataset.)")
            os._exit(1)


def start(timeout_s: float, rank: int) -> Watchdog:
    global _ACTIVE
    if _ACTIVE is None:
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
