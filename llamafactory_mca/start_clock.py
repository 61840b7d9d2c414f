"""Where a run's start went, from the command to its first step, across the launcher and rank 0.

Most of that wait is not in the rank: the launcher imports LLaMA-Factory, transformers and Megatron-Core, checks the
recipe and forks the ranks with all of it imported, so a rank's own clock starts late. The launcher marks its phases
in the environment, which forked and spawned ranks inherit alike; rank 0 adds its own and the startup summary's
``startup`` line says them all.
"""

from __future__ import annotations

import os
import time


CLOCK_ENV = "LLAMAFACTORY_MCA_START_CLOCK"

# the launcher's marks, in order, and what happened before each
COMMAND, CHECKED, IMPORTED = "command", "checked", "imported"

# When this process began: the startup hook imports this module as the interpreter starts (under USE_MCA; our own
# commands at their first import), and a forked child starts the clock again. time.time(), not the process's
# creation time the kernel keeps: that one counts from a boot time rounded to the second.
_started = time.time()


def _forked() -> None:
    global _started
    _started = time.time()


os.register_at_fork(after_in_child=_forked)


def process_started() -> float:
    return _started


def start() -> None:
    """The launcher's first mark: its process's start (a parent's marks, if any, are not this run's)."""
    os.environ[CLOCK_ENV] = ""
    mark(COMMAND, _started)


def mark(name: str, at: float | None = None) -> None:
    if CLOCK_ENV in os.environ:  # only in a run the launcher started
        os.environ[CLOCK_ENV] += f"{name}={time.time() if at is None else at:.3f};"


def marks() -> dict[str, float]:
    found = {}
    for part in os.environ.get(CLOCK_ENV, "").split(";"):
        name, _, value = part.partition("=")
        if name and value:
            found[name] = float(value)
    return found


def forked() -> bool:
    """Whether the launcher imported what the ranks run and forked them (else they were spawned, or started by a bare
    torchrun, and imported it themselves)."""
    return IMPORTED in marks()


def launcher_phases(rank_start: float) -> tuple[float, str] | None:
    """The launcher's time until this rank began, and how it split; None without a launcher of ours (a bare
    torchrun). A spawned rank imports for itself: its launcher's part ends at the checks."""
    at = marks()
    if COMMAND not in at or CHECKED not in at:
        return None
    parts = [f"LLaMA-Factory's imports and the recipe's checks {at[CHECKED] - at[COMMAND]:.1f} s"]
    if forked():
        parts += [f"the ranks' imports {at[IMPORTED] - at[CHECKED]:.1f} s",
                  f"forking {max(rank_start - at[IMPORTED], 0.0):.1f} s"]
    else:
        parts += [f"spawning {max(rank_start - at[CHECKED], 0.0):.1f} s"]
    return rank_start - at[COMMAND], ", ".join(parts)
