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
import traceback

import torch
import torch.multiprocessing as mp


_HELD = 0


@contextlib.contextmanager
def one_job_at_a_time():
    """One multi-process job (a gloo run here, a real command in tests/_cli.py) at a time across pytest-xdist's
    workers. Ranks step in lockstep: two jobs of 4-8 ranks on a 2-core machine stall each other at every collective
    (most of their time went to the scheduler), where one job alone keeps both cores busy; single-process tests still
    run beside it. Reentrant within a process."""
    global _HELD
    if _HELD:
        _HELD += 1
        try:
            yield
        finally:
            _HELD -= 1
        return
    with open(os.path.join(tempfile.gettempdir(), f"llamafactory_mca-tests-{os.getuid()}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _HELD = 1
        try:
            yield
        finally:
            _HELD = 0
            fcntl.flock(lock, fcntl.LOCK_UN)


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
    with one_job_at_a_time():
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
