"""Megatron's checkpoint file writers, watched.

Each rank writes its part of a checkpoint through processes it forks, one per bucket of files
(``FileSystemWriterAsync.write_preloaded_data_multiproc``, megatron-core 0.16), which report through a queue. Upstream
waits for them on a ``JoinableQueue.join()`` that a writer killed mid-save (kill -9, the out-of-memory killer) never
releases: that rank hangs in the save while the others wait for it, until ``ddp_timeout`` ends the run with a
traceback. Here the rank collects the writers' results with a timeout and looks at their exit codes between tries: a
writer that ended without reporting fails the save at once (every rank raises in Megatron's finalize, which gathers
the write results), and ``describe_failure`` turns that into one line every rank agrees on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import signal
from collections.abc import Callable, Iterator
from typing import Any

import torch


POLL_SECONDS = 0.5
_in_writer: Callable[[], None] | None = None  # runs first in every writer of the save in progress (faults.py)
_failure: str | None = None  # this rank's dead writer in the save in progress, for describe_failure


class WriterDied(RuntimeError):
    """A checkpoint writer process of this rank ended without handing back its results."""


def install() -> None:
    """Megatron's writer pool replaced by ours (idempotent; the in-process queue beside it is write_folder's)."""
    # here: checkpoints/ loads without Megatron (reading, verifying)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync, _disable_gc

    if not getattr(FileSystemWriterAsync.write_preloaded_data_multiproc, "watched", False):
        watched = _disable_gc()(_write_watched)  # as upstream: no GC while tensors are shared with forked writers
        watched.watched = True
        FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(watched)


@contextlib.contextmanager
def watching(in_writer: Callable[[], None] | None = None) -> Iterator[None]:
    """One save: ``in_writer`` runs first in each writer process (a deliberate fault in tests)."""
    global _in_writer, _failure
    _in_writer, _failure = in_writer, None
    try:
        yield
    finally:
        _in_writer = None


def _write_watched(transform_list: list, use_msc: bool, rank: int, write_buckets: list,
                   global_results_queue: Any) -> None:
    """Upstream's signature and results: a dict of each writer's results, or the exception that stopped one."""
    ctx = mp.get_context("fork")
    results, done = ctx.Queue(), ctx.JoinableQueue()  # done: upstream's writers take one item off it when finished
    writers = []
    for index, bucket in enumerate(write_buckets):
        done.put(index)
        writers.append(ctx.Process(target=_writer, args=(transform_list, index, bucket, results, done, use_msc)))
    for writer in writers:
        writer.start()
    outcome = _collect(writers, results, rank)
    for writer in writers:
        if isinstance(outcome, Exception) and writer.is_alive():
            writer.kill()
        writer.join()
    global_results_queue.put(outcome)


def _writer(transform_list: list, index: int, bucket: Any, results: Any, done: Any, use_msc: bool) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync  # here: as above

    if _in_writer is not None:
        _in_writer()
    FileSystemWriterAsync.write_preloaded_data(transform_list, local_proc_idx=index, write_bucket=bucket,
                                               results_queue=results, count_queue=done, use_fsync=True,
                                               **({"use_msc": True} if use_msc else {}))


def _collect(writers: list, results: Any, rank: int) -> dict | Exception:
    global _failure
    got: dict[int, Any] = {}
    while len(got) < len(writers):
        try:
            index, value = results.get(timeout=POLL_SECONDS)
        except queue.Empty:
            dead = [(i, w.exitcode) for i, w in enumerate(writers) if i not in got and w.exitcode not in (None, 0)]
            if dead:
                index, code = dead[0]
                _failure = (f"rank {rank}'s checkpoint writer (process {index + 1} of {len(writers)}, pid "
                            f"{writers[index].pid}) {_how(code)}")
                return WriterDied(_failure)
            continue
        if isinstance(value, Exception):
            return value
        got[index] = value
    return got


def _how(exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        return ("was killed by SIGKILL (kill -9, or the out-of-memory killer)" if name == "SIGKILL"
                else f"was stopped by {name}")
    return f"exited with code {exitcode}"


def describe_failure() -> str | None:
    """Collective, after a save raised on every rank: what the ranks' writers say, the same text on each; None when
    no writer of any rank died (the error is something else)."""
    said: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(said, _failure)
    found = [s for s in said if s]
    return "; ".join(found) if found else None
