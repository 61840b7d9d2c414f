"""Per-layer CUDA graphs (megatron-core's ``CudaGraphManager``, ``cuda_graph_impl="local"``) as the trainer runs them.

The first training step runs each layer eagerly and records its call; at the step's end the schedule captures every
layer's forward and backward graph (``create_cudagraphs``); later steps replay them, one launch per layer and
direction instead of hundreds. A graph replays one set of shapes and megatron-core has no eager fallback once graphs
exist, so the micro-batches of a graphed run all have one shape (``MicroBatch.with_slots``), and anything else that
runs the layers — evaluation, whose micro-batches differ — runs them with the graphs set aside.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from megatron.core.pipeline_parallel import schedules


MANAGER = "cudagraph_manager"  # the attribute megatron-core's layers test to route a call through their graphs
_CAPTURE = {"seconds": 0.0}


def time_capture() -> None:
    """megatron-core 0.16.x captures the graphs at the end of step 1 (``schedules.create_cudagraphs``) and returns how
    long that took, which its schedules drop: kept here for the step-1 line (:func:`capture_seconds`)."""
    create = schedules.create_cudagraphs
    if getattr(create, "timed", False):
        return

    def timed():
        stats = create()
        if stats:
            _CAPTURE["seconds"] += stats.get("time", 0.0)
        return stats

    timed.timed = True
    schedules.create_cudagraphs = timed


def capture_seconds() -> float:
    return _CAPTURE["seconds"]


@contextmanager
def eager_layers(chunks: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Run the chunks' layers eagerly inside the block (a no-op for a run without graphs)."""
    held = [(module, module._modules.pop(MANAGER)) for chunk in chunks for module in chunk.modules()
            if MANAGER in module._modules]
    try:
        yield
    finally:
        for module, manager in held:
            module._modules[MANAGER] = manager

