"""Ctrl-C that lands where Python ignores exceptions.

torch's elastic agent turns SIGINT and SIGTERM into an exception (``SignalException``) raised wherever the launcher's
main thread happens to be. While it forks the ranks, that can be inside one of the fork hooks that ``logging``
registers (``os.register_at_fork``), and Python only prints an exception raised there ("Exception ignored in ...",
with a traceback) and goes on: the launcher then forks the remaining ranks as if no one had pressed Ctrl-C, logging's
module lock is left taken, and the run ends as a crashed rank (exit 1) instead of an interrupted one (exit 130).

:class:`SwallowedSignals`, installed as ``sys.unraisablehook`` while the launcher runs the workers, keeps such a
signal off the screen, puts logging's lock back the way the interrupted hook would have left it, and sends the signal
again to the main thread from a short-lived thread, so that it is raised where torch's agent handles it.
"""

from __future__ import annotations

import _thread
import logging
import signal
import sys
import threading
import time


# logging's fork hooks: the one run before fork() takes the module lock, the one after it in the parent gives it
# back (Python 3.11-3.12 names, then 3.13's).
_TAKES_LOCK = ("_acquireLock", "_prepareFork")
_GIVES_LOCK_BACK = ("_releaseLock", "_afterFork")
_AGAIN_AFTER_S = 0.02  # long enough for the hook that caught the signal to return before it comes again


class SwallowedSignals:
    def __init__(self, signal_exception: type[BaseException]):
        self._signal_exception = signal_exception
        self.signum: int | None = None  # the last signal that was swallowed, once one was
        self._sending = False  # one at a time: the second of two would interrupt the agent's shutdown
        self._previous = None  # the hook in place when the block began (__enter__)

    def __enter__(self) -> SwallowedSignals:
        self._previous = sys.unraisablehook
        sys.unraisablehook = self
        return self

    def __exit__(self, *exc) -> None:
        sys.unraisablehook = self._previous

    def __call__(self, unraisable) -> None:
        error = unraisable.exc_value
        if not isinstance(error, (self._signal_exception, KeyboardInterrupt)):
            self._previous(unraisable)
            return
        self.signum = int(getattr(error, "sigval", signal.SIGINT))
        _finish_logging_hook(unraisable.object)
        if not self._sending:
            self._sending = True
            # a thread that is not waited for (threading.Thread.start waits, in Python, where the signal could come
            # back inside this hook)
            _thread.start_new_thread(self._send_again, (threading.main_thread().ident,))

    def _send_again(self, main_thread: int) -> None:
        time.sleep(_AGAIN_AFTER_S)
        self._sending = False
        signal.pthread_kill(main_thread, self.signum)


def _finish_logging_hook(hook) -> None:
    """Do what logging's fork hook was about to do when the signal stopped it at its first line, and nothing if it
    stopped after (the launcher's main thread holds logging's lock only between those two hooks)."""
    owned = logging._lock._is_owned()
    if any(hook is getattr(logging, name, None) for name in _TAKES_LOCK) and not owned:
        logging._lock.acquire()
    elif any(hook is getattr(logging, name, None) for name in _GIVES_LOCK_BACK) and owned:
        logging._lock.release()
