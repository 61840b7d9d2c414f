"""The FP8 weight gradient added into the fp32 ``main_grad`` inside its GEMM: cuBLASLt with beta = 1.

``torch._scaled_mm`` writes its output and cannot accumulate into it (it has no beta), so an FP8 weight gradient
was written as an fp32 tensor and added to ``main_grad`` in a second pass: on the Qwen3-8B shape at 8 layers, 217
adds a step and 5% of its GPU time (``h100_fp8/call10``), more than the casts and their maxima together. bf16
linears never pay it: their weight-gradient GEMM accumulates with beta = 1 (``wgrad.py``). cuBLASLt, the library
``_scaled_mm`` calls, takes a C matrix and beta for FP8 inputs into an fp32 D as well (Transformer Engine's
``accumulate`` GEMM); torch only does not expose it. So this module calls it through ``ctypes``, on the library
torch has already loaded, with torch's stream and a workspace of ours: descriptors and the heuristic's algorithm
made once per shape, each call then setting the two scale pointers and launching, capturable in a CUDA graph.

Anything unexpected (no such library, a status other than success) logs once and returns False: the caller then
runs ``_scaled_mm`` and the add, as before.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch


logger = logging.getLogger(__name__)

# cublasLt.h / library_types.h / cublas_api.h (CUDA 12 and 13 alike)
_COMPUTE_32F, _R_32F = 68, 0
_TYPES = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29, torch.float32: 0}
_DESC_SCALE_TYPE, _DESC_TRANSA, _DESC_TRANSB = 1, 3, 4
_DESC_A_SCALE, _DESC_B_SCALE, _DESC_FAST_ACCUM = 17, 18, 25
_PREF_WORKSPACE, _PREF_ALIGN_A, _PREF_ALIGN_B, _PREF_ALIGN_C, _PREF_ALIGN_D = 1, 5, 6, 7, 8
_OP_N, _OP_T = 0, 1
WORKSPACE = 32 << 20  # what torch gives cuBLASLt on Hopper


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL | None:
    """The cuBLASLt torch linked (one copy in the process: its handle and its heuristics cache)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


class _Lt:
    """One process's cuBLASLt: its library, a handle and a workspace per device, a plan per GEMM shape."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        ptr, size, u64, i64, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
        for name, args in (("cublasLtCreate", [ptr]), ("cublasLtMatmulDescCreate", [ptr, i32, i32]),
                           ("cublasLtMatmulDescSetAttribute", [ptr, i32, ptr, size]),
                           ("cublasLtMatrixLayoutCreate", [ptr, i32, u64, u64, i64]),
                           ("cublasLtMatmulPreferenceCreate", [ptr]), ("cublasLtMatmulPreferenceDestroy", [ptr]),
                           ("cublasLtMatmulPreferenceSetAttribute", [ptr, i32, ptr, size]),
                           ("cublasLtMatmulAlgoGetHeuristic", [ptr] * 7 + [i32, ptr, ptr]),
                           ("cublasLtMatmul", [ptr] * 14 + [size, ptr])):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, i32
        self.handles: dict[int, tuple[ctypes.c_void_p, torch.Tensor]] = {}
        self.plans: dict[tuple, tuple[ctypes.c_void_p, list[ctypes.c_void_p], _Heuristic]] = {}
        self.one = ctypes.c_float(1.0)

    def check(self, status: int, what: str) -> None:
        if status:
            raise RuntimeError(f"{what}: cuBLAS status {status}")

    def set(self, setter: Any, obj: ctypes.c_void_p, attr: int, value: Any) -> None:
        self.check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attr}")

    def handle(self, device: int) -> tuple[ctypes.c_void_p, torch.Tensor]:
        if device not in self.handles:
            h = ctypes.c_void_p()
            self.check(self.lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
            self.handles[device] = h, torch.empty(WORKSPACE, dtype=torch.uint8, device=device)
        return self.handles[device]

    def plan(self, key: tuple, handle: ctypes.c_void_p) -> tuple[ctypes.c_void_p, list[ctypes.c_void_p], _Heuristic]:
        """The matmul descriptor, the four layouts and the algorithm for one shape, dtypes and alignment."""
        if key in self.plans:
            return self.plans[key]
        m, n, k, a_type, b_type, aligns = key
        lib = self.lib
        desc = ctypes.c_void_p()
        self.check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        for attr, value in ((_DESC_SCALE_TYPE, ctypes.c_int32(_R_32F)), (_DESC_TRANSA, ctypes.c_int32(_OP_T)),
                            (_DESC_TRANSB, ctypes.c_int32(_OP_N)), (_DESC_FAST_ACCUM, ctypes.c_int8(0))):
            self.set(lib.cublasLtMatmulDescSetAttribute, desc, attr, value)
        layouts = []
        for dtype, rows, cols in ((a_type, k, m), (b_type, k, n), (_R_32F, m, n), (_R_32F, m, n)):
            layout = ctypes.c_void_p()
            self.check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, rows),
                       "cublasLtMatrixLayoutCreate")
            layouts.append(layout)
        pref = ctypes.c_void_p()
        self.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        self.set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_WORKSPACE, ctypes.c_uint64(WORKSPACE))
        for attr, align in zip((_PREF_ALIGN_A, _PREF_ALIGN_B, _PREF_ALIGN_C, _PREF_ALIGN_D), aligns):
            self.set(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(align))
        found, count = _Heuristic(), ctypes.c_int(0)
        self.check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, *layouts, pref, 1, ctypes.byref(found),
                                                      ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1 or found.state:
            raise RuntimeError(f"no cuBLASLt algorithm for an FP8 GEMM of {m} x {n} x {k} into fp32")
        self.plans[key] = desc, layouts, found
        return self.plans[key]

    def accumulate(self, a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
                   out: torch.Tensor) -> None:
        """out [n, m] (row-major) += (a [m, k] @ b [n, k]^T)^T scaled: column-major, D [m, n] = A^T B."""
        (m, k), n = a.shape, b.shape[0]
        aligns = tuple(_alignment(t) for t in (a, b, out, out))
        handle, workspace = self.handle(out.device.index)
        desc, layouts, found = self.plan((m, n, k, _TYPES[a.dtype], _TYPES[b.dtype], aligns), handle)
        for attr, scale in ((_DESC_A_SCALE, scale_a), (_DESC_B_SCALE, scale_b)):
            self.set(self.lib.cublasLtMatmulDescSetAttribute, desc, attr, ctypes.c_void_p(scale.data_ptr()))
        self.check(self.lib.cublasLtMatmul(
            handle, desc, ctypes.byref(self.one), a.data_ptr(), layouts[0], b.data_ptr(), layouts[1],
            ctypes.byref(self.one), out.data_ptr(), layouts[2], out.data_ptr(), layouts[3], ctypes.byref(found.algo),
            workspace.data_ptr(), WORKSPACE, torch.cuda.current_stream(out.device).cuda_stream), "cublasLtMatmul")


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 dividing the tensor's address (what cuBLASLt may assume)."""
    ptr = t.data_ptr()
    return min(256, ptr & -ptr) if ptr else 256


_state: dict[str, Any] = {}


def _lt() -> _Lt | None:
    if "lt" not in _state:
        try:
            lib = _library()
            why = "torch has not loaded it"
        except OSError as error:
            lib, why = None, str(error)
        if lib is None:
            logger.warning("FP8: cuBLASLt could not be opened (%s); weight gradients are added to main_grad after "
                           "their GEMM.", why)
        _state["lt"] = _Lt(lib) if lib is not None else None
    return _state["lt"]


def accumulate(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
               out: torch.Tensor) -> bool:
    """``out += (a @ b^T) * scale_a * scale_b`` for FP8 ``a`` [rows, k], ``b`` [cols, k] (both contiguous, k the
    tokens: the weight gradient ``dy^T x`` with a = dy^T, b = x^T), tensorwise scales, ``out`` [rows, cols] fp32
    contiguous, in one cuBLASLt GEMM; False (nothing done) where that cannot run."""
    if not (out.is_cuda and out.dtype == torch.float32 and out.is_contiguous() and a.is_contiguous()
            and b.is_contiguous() and scale_a.numel() == 1 and scale_b.numel() == 1):
        return False
    lt = _lt()
    if lt is None:
        return False
    try:  # column-major: D [cols, rows] = op(x^T-as-stored) . dy^T-as-stored, the roles of a and b swapped
        lt.accumulate(b, scale_b, a, scale_a, out)
    except (RuntimeError, KeyError) as error:
        _state["lt"] = None
        logger.warning("FP8: cuBLASLt's accumulating GEMM failed (%s); weight gradients are added to main_grad "
                       "after their GEMM from here on.", error)
        return False
    return True
