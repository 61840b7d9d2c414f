"""Deliberate crashes at named points, so tests can prove that resume survives them.

``LLAMAFACTORY_MCA_FAULT=step:3`` kills every rank before step 3 runs; ``save:4`` kills them in the middle
of writing checkpoint-4 (its dist checkpoint written, the folder not yet renamed). Unset in real runs.
"""

from __future__ import annotations

import os
import sys

FAULT_ENV = "LLAMAFACTORY_MCA_FAULT"


def maybe_crash(point: str, step: int) -> None:
    if os.environ.get(FAULT_ENV) == f"{point}:{step}":
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every rank dies at the same point
        print(f"[llamafactory_mca] {FAULT_ENV}={point}:{step}: crashing on purpose", file=sys.stderr, flush=True)
        import psutil

        for child in psutil.Process().children(recursive=True):  # checkpoint writers etc. die with us, as in a crash
            child.kill()
        os._exit(17)
