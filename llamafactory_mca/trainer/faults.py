"""Deliberate faults at named points, so tests can prove that resume, skipping and the watchdog work.

``LLAMAFACTORY_MCA_FAULT`` holds ``point:step`` or ``point:step@rank`` (only that rank), comma-separated:

- ``step:3``: every rank dies before step 3 runs; ``save:4``: in the middle of writing checkpoint-4 (its dist
  checkpoint written, the folder not yet renamed); ``writer:4@1``: a checkpoint writer process of rank 1 is killed
  with SIGKILL as it starts writing checkpoint-4 (what kill -9 or the out-of-memory killer does to one);
  ``interrupt:4``: Ctrl-C in the middle of writing checkpoint-4 (SIGINT to the run's process group, as a terminal
  sends it, where ``save:4`` crashes);
- ``hang:2@1``: rank 1 stops before step 2 (sleeps), as a stuck GPU or a lost node would;
- ``nan:2``: step 2's loss is NaN; ``nan:2+``: every loss from step 2 on.

Unset in real runs.
"""

from __future__ import annotations

import os
import signal
import sys
import time


FAULT_ENV = "LLAMAFACTORY_MCA_FAULT"


def _matches(point: str, step: int) -> bool:
    rank = os.environ.get("RANK", "0")
    for entry in os.environ.get(FAULT_ENV, "").split(","):
        name, _, spec = entry.strip().partition(":")
        spec, _, only = spec.partition("@")
        if name != point or (only and only != rank) or not spec.rstrip("+").isdigit():
            continue
        first = int(spec.rstrip("+"))
        if step == first or (spec.endswith("+") and step >= first):
            return True
    return False


def maybe_crash(point: str, step: int) -> None:
    if not _matches(point, step):
        return
    import torch  # here: this module loads without torch; only a fault point that fires needs it

    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank dies at the same point
    print(f"[llamafactory_mca] {FAULT_ENV}={point}:{step}: crashing on purpose", file=sys.stderr, flush=True)
    import psutil  # here: as torch above

    for child in psutil.Process().children(recursive=True):  # checkpoint writers etc. die with us, as in a crash
        child.kill()
    os._exit(17)


def before_commit(step: int) -> None:
    """Between a checkpoint's written files and its folder's rename: the moment a save is most easily torn."""
    maybe_crash("save", step)
    if _matches("interrupt", step) and os.environ.get("RANK", "0") == "0":
        os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(5)  # the signal lands here, mid-save, as a keypress would


def kill_writer(step: int) -> None:
    """In a checkpoint writer process (forked by its rank: RANK is the rank's)."""
    if _matches("writer", step):
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_hang(step: int) -> None:
    if _matches("hang", step):
        while True:
            time.sleep(60)


def nan_loss(step: int) -> bool:
    return _matches("nan", step)
