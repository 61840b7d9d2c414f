"""Megatron-Core on CPU: the answers to its CUDA questions when no GPU is present.

Megatron-Core's training step is written for GPUs, but nothing in its math needs one. On a machine
without CUDA (CI, laptops) we answer the handful of CUDA calls it makes so that the whole path —
model build, pipeline schedule, DDP, distributed optimizer, dist checkpointing, MoE dispatch — runs
on CPU over gloo. Applied once per process, only when ``torch.cuda.is_available()`` is false.
Everything here is process-global by nature; keep it small and in one place.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


logger = logging.getLogger(__name__)

_ACTIVE = False
_MODE: TorchFunctionMode | None = None

# Megatron's distributed optimizer checks ``param.type()`` against these names.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
}


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, int) and not isinstance(value, bool)


class _CudaToCpu(TorchFunctionMode):
    """Sends tensors that Megatron asks to create on "cuda" to the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA runtime
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) and not isinstance(a, int) else a for a in args)
        return func(*args, **kwargs)


class _Stream:
    """Stand-in for ``torch.cuda.Stream`` (MoE dispatch and overlap code create side streams)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _RNGTracker:
    """Megatron's CUDA RNG tracker without CUDA: forks are plain CPU RNG scopes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        yield


def cpu_mode_needed() -> bool:
    return not torch.cuda.is_available()


def is_active() -> bool:
    return _ACTIVE


def apply_cpu_mode() -> None:
    """Patch torch.cuda and Megatron-Core for a GPU-less process. Idempotent."""
    global _ACTIVE, _MODE
    if _ACTIVE:
        return
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda *a, **k: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None

    mrandom.CudaRNGStatesTracker = _RNGTracker
    mrandom._CUDA_RNG_STATE_TRACKER = _RNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.initialize_rng_tracker = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()

    # The alltoall dispatcher moves split sizes to host memory, as numpy when asked.
    original_move = moe_utils.maybe_move_tensor_to_cpu

    def _move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = _move_to_cpu
    from megatron.core.transformer.moe import token_dispatcher

    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = _move_to_cpu

    # torch.compile on a CPU (Megatron's fused functions: its ``jit_fuser`` is torch.compile) builds C++ kernels with
    # inductor in every rank at step 1: an 8-rank recipe on a 2-core machine spent 25 of its 62 s there. Eager CPU
    # kernels compute the same, and a CPU has no launch overhead to save.
    torch._dynamo.config.disable = True
    _MODE = _CudaToCpu()
    _MODE.__enter__()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _ACTIVE = True
    logger.info("CPU mode: no GPU found, Megatron-Core runs on CPU over gloo.")
