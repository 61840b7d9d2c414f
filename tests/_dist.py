"""Run a function on N CPU processes over gloo: the multi-process harness of the test suite.

The ranks are forked by multiprocessing's fork server, which imports torch, transformers, Megatron-Core and our
trainer once per pytest process: a rank then starts in a fraction of a second instead of spending ~8 s of CPU on
imports, which on a 2-core CI machine is most of what a small multi-rank test costs. Nothing is initialised in the
server (no process group, no Megatron state), so each rank starts as clean as a spawned one. On a GPU machine the
server preloads nothing: an import there initialises CUDA, which a forked rank could not use.
"""

import contextlib
import fcntl
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


_HELD = 0
SMALL = 2  # processes: a job of at most this many shares the machine with one other such job


def _slot_files() -> list:
    return [open(os.path.join(tempfile.gettempdir(), f"llamafactory_mca-tests-{os.getuid()}.{i}.lock"), "w")
            for i in range(2)]


@contextlib.contextmanager
def one_job_at_a_time(processes: int | None = None):
    """Multi-process jobs (a gloo run here, a real command in tests/_cli.py) across pytest-xdist's workers: one job
    of more than two processes at a time, or two of at most two. Ranks step in lockstep: two jobs of 4-8 ranks on a
    2-core machine stall each other at every collective (most of their time went to the scheduler), where one job
    alone keeps both cores busy. A small job is mostly start-up, one process at a time (the launcher's imports and
    checks, then torchrun's), which leaves the second core idle; two of them overlap there. ``processes``: how many
    the job runs (None: as a large job). Single-process tests still run beside either. Reentrant within a
    process."""
    global _HELD
    if _HELD:
        _HELD += 1
        try:
            yield
        finally:
            _HELD -= 1
        return
    files = _slot_files()
    try:
        if processes is not None and processes <= SMALL:
            taken = [_one_free_slot(files)]
        else:
            for f in files:  # in order, as every large job takes them: no two wait on each other
                fcntl.flock(f, fcntl.LOCK_EX)
            taken = files
        _HELD = 1
        try:
            yield
        finally:
            _HELD = 0
            for f in taken:
                fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        for f in files:
            f.close()


def _one_free_slot(files: list):
    while True:
        for f in files:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return f
            except BlockingIOError:
                pass
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from llamafactory_mca.parallel import end_worker

    try:
        results[rank] = ("ok", fn(*args))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
    end_worker()  # the result is with the parent: leave before interpreter teardown (see its docstring)


PRELOAD = ["torch", "transformers", "megatron.core", "datasets", "llamafactory_mca.trainer.trainer",
           "llamafactory_mca.models.auto"]


def run_distributed(fn, world_size: int, *args, retries: int = 3) -> list:
    """Call ``fn(*args)`` on every rank; return each rank's result. A taken port is retried."""
    ctx = mp.get_context("forkserver")
    if not torch.cuda.is_available():  # on a GPU machine an import initialises CUDA, which a forked rank cannot use
        ctx.set_forkserver_preload(PRELOAD)
    _start_server()
    with one_job_at_a_time(world_size):
        return _run(ctx, fn, world_size, args, retries)


def _start_server() -> None:
    """Start the fork server with one OpenMP thread per rank. OpenMP reads its settings when torch is imported, in
    the server, so ``torch.set_num_threads`` in a rank comes too late: with the server's default pool, MKL's GEMMs
    spun OpenMP threads against each other on 4 ranks of 2 cores (a TP2 case of the layouts walk took 9-17 s
    instead of 1.5 s)."""
    from multiprocessing import forkserver

    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _run(ctx, fn, world_size: int, args: tuple, retries: int) -> list:
    for attempt in range(retries):
        with ctx.Manager() as manager:
            results = manager.dict()
            try:
                mp.start_processes(_entry, args=(world_size, free_port(), fn, args, results), nprocs=world_size,
                                   join=True, start_method="forkserver")
            except mp.ProcessExitedException as err:
                # A rank that died before reporting fails the test. One that reported and then died on the way out
                # finished what the test checks, so its results stand.
                done = dict(results)
                if len(done) < world_size or any(status != "ok" for status, _ in done.values()):
                    raise
                print(f"run_distributed: every rank reported, then {err}")
            results = dict(results)
        errors = {r: v for r, (status, v) in results.items() if status == "error"}
        if errors and attempt + 1 < retries and all("EADDRINUSE" in e or "Address already in use" in e
                                                     for e in errors.values()):
            continue
        assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items()))
        return [results[r][1] for r in range(world_size)]
    raise AssertionError("unreachable")
