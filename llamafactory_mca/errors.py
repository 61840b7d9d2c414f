"""User errors: one clear message, printed once, no traceback, last on screen.

A ``UserError`` is a mistake the user can fix (a key, a size, a path); its message names the field, the
value and the fix. Every entry point (the launcher's preflight, the workers, ``convert``, the merge script)
runs inside :func:`user_errors`, which prints it as one block on stderr and exits non-zero. Anything else
is a bug and keeps its traceback. ``LLAMAFACTORY_MCA_DEBUG=1`` shows tracebacks for user errors too.

Workers started by our torchrun wrapper (``launch/torchrun.py``) do not print: the first rank to fail writes its
message to ``LLAMAFACTORY_MCA_ERROR_FILE`` and the wrapper prints it after torchrun has finished, so it is
the last thing on screen and appears once however many ranks hit it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


ERROR_FILE_ENV = "LLAMAFACTORY_MCA_ERROR_FILE"
STATUS_DIR_ENV = "LLAMAFACTORY_MCA_STATUS_DIR"  # where each worker posts where it stands (watchdog.py)
LAUNCHER_PID_ENV = "LLAMAFACTORY_MCA_LAUNCHER_PID"  # the process whose end ends the workers (watchdog.py)
DEBUG_ENV = "LLAMAFACTORY_MCA_DEBUG"
PREFIX = "[llamafactory_mca] error: "


class UserError(ValueError):
    """A mistake in the user's recipe, data, paths or environment (a ValueError, as checks raised before)."""


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def format_error(message: str) -> str:
    return PREFIX + str(message).strip()


def record_for_launcher(message: str) -> bool:
    """Worker side: hand the message to the launcher (first writer wins). False without a launcher."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return True  # another rank said it already
    except OSError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(format_error(message))
    return True


def report(message: str) -> None:
    """Print ``message`` as the run's one error block (or pass it to the launcher, from a worker)."""
    if record_for_launcher(message):
        return
    sys.stdout.flush()
    print(format_error(message), file=sys.stderr, flush=True)


@contextlib.contextmanager
def user_errors(exit_code: int = 1, also: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Turn ``UserError`` (and the ``also`` types, e.g. ValueError while parsing a recipe) into one message
    and ``SystemExit(exit_code)``."""
    try:
        yield
    except (UserError, *also) as err:
        if debug_enabled():
            raise
        report(str(err))
        raise SystemExit(exit_code) from None
