"""Version workarounds for Megatron-Core, gated on what is installed, and the list of every place we change an
upstream package's behaviour.

Each fix here names the version it was seen in and the condition it is applied under, so it can be dropped when that
version is no longer supported. Upstream behaviour is changed elsewhere only where it is that module's subject; all
of them are listed in ``UPSTREAM_CHANGES`` with the versions they were written against (``WRITTEN_AGAINST``, the
pins CI proves): another installed version gets one line at start-up (:func:`version_note`) naming what may no
longer hold, rather than a failure deep in a rank.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import types
from functools import cache, partial


WRITTEN_AGAINST = {"llamafactory": "0.9.5", "megatron-core": "0.16.1", "transformers": "5.6.0"}
# (package, where, what of it we change)
UPSTREAM_CHANGES = (
    ("llamafactory", "launch/plugin.py",
     "its parser (our checks), launcher (our torchrun) and tuner (rm and kto to ours)"),
    ("llamafactory", "launch/torchrun.py", "extras/misc.py's import-time bf16 check, answered from NVML (no cuInit)"),
    ("llamafactory", "launch/board.py", "LlamaBoard's private _parse_train_args and _initialize (the Megatron keys)"),
    ("megatron-core", "compat.py", "the router's te_general_gemm, clip_grads' norm and scale, MLA's TE check, MTP's "
                                   "packed roll and its recompute's arguments, jit_fuser compiling on first call"),
    ("megatron-core", "cpu_mode.py", "CUDA streams, events, the RNG tracker and MoE's device moves, on CPUs"),
    ("megatron-core", "trainer/param_remainders.py", "the distributed optimizer's Adam (fp32 masters as remainders)"),
    ("megatron-core", "trainer/graphs.py", "the schedules' create_cudagraphs, timed for the step-1 line"),
    ("megatron-core", "models/native/", "the layer spec's attention, norms, RoPE, experts and loss"),
    ("megatron-core", "models/lora/layers.py", "adapter classes mixed into the parallel linears"),
    ("megatron-core", "checkpoints/writers.py", "the checkpoint writer's results queue and processes, watched"),
    ("transformers", "trainer/reporting.py", "the tracker callbacks, handed our model's config and size"),
)


def version_note() -> str | None:
    """One line when an installed package is not the version our changes to it were written against."""
    from importlib.metadata import PackageNotFoundError, version

    drift = []
    for package, written in WRITTEN_AGAINST.items():
        try:
            installed = version(package)
        except PackageNotFoundError:
            continue
        if installed != written:
            where = ", ".join(f"{place} ({what})" for name, place, what in UPSTREAM_CHANGES if name == package)
            drift.append(f"{package} {installed} (written against {written}: {where})")
    if not drift:
        return None
    return ("[llamafactory_mca] note: " + "; ".join(drift) + ". These changes may no longer hold: if a run fails "
            "inside them, install the versions in requirements/stack.txt.")



def fp8_unsupported() -> str | None:
    """Why this machine cannot run FP8 GEMMs (None: it can): torch's ``_scaled_mm`` needs compute capability 8.9+.
    Asked of ``nvidia-smi``, so the launcher opens no CUDA context before its workers start."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "this machine has no NVIDIA GPU (no nvidia-smi)"
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
        gpus = [line.rsplit(",", 1) for line in out.strip().splitlines() if line.strip()]
        old = [f"{name.strip()} ({cap.strip()})" for name, cap in gpus
               if tuple(int(v) for v in cap.strip().split(".")) < (8, 9)]
    except (OSError, subprocess.SubprocessError, ValueError):
        return "nvidia-smi could not tell this machine's GPUs' compute capability"
    if not gpus:
        return "nvidia-smi lists no GPU"
    return f"{', '.join(old)} has not" if old else None


@cache
def has_transformer_engine() -> bool:
    """True when Transformer Engine's PyTorch bindings import (not merely a stub on the path)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


JIT_MODULE = "megatron.core.jit"


def compile_on_first_call(jit: types.ModuleType) -> None:
    """megatron-core 0.16.x: ``megatron.core.jit`` (imported early in ``megatron.core``'s own import) sets
    ``jit_fuser = torch.compile``, which some forty functions are decorated with while Megatron imports: the first
    decoration imports torch's inductor (0.7 s of a 2-core CPU; seconds on a GPU host), in the launcher and in every
    spawned rank, though our layer spec calls few of those functions or none (dense: none). Run under USE_MCA (the
    startup hook's import finder calls this right after the module runs), each is compiled when first called
    instead: what torch.compile does itself on the first call, without the import up front."""
    jit.jit_fuser = _compiled_on_first_call


def _compiled_on_first_call(function):
    compiled = None

    @functools.wraps(function)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch  # here: loaded already by the module this decorates; compat.py imports nothing heavy

            compiled = torch.compile(function)
        return compiled(*args, **kwargs)

    return call


_APPLIED = False


def apply_megatron_fixes() -> None:
    """Apply once per process, before any model is built."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.x: without TE the router's `router_gating_linear` reads a module-level
    # `te_general_gemm` that was never defined (NameError on GPU as well as CPU).
    if not has_transformer_engine() and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # megatron-core 0.16.x without apex or TE: clip_grads falls back to `local_multi_tensor_l2_norm`, which turns
    # every gradient's norm into a Python float (one device-to-host sync per parameter tensor, ~230 per step on a
    # 28-layer model) and `local_multi_tensor_scale`, one kernel pair per tensor. torch's foreach kernels give the
    # same values with no sync.
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = foreach_scale

    # megatron-core 0.16.x without TE: multi_latent_attention.py imports TE's wrappers from a module that stubs them
    # with MagicMocks when TE is missing, so its HAVE_TE is True and `isinstance(x, TELinear)` raises a TypeError.
    from megatron.core.transformer import multi_latent_attention

    if not has_transformer_engine() and multi_latent_attention.HAVE_TE:
        multi_latent_attention.HAVE_TE = False
        multi_latent_attention.TELinear = multi_latent_attention.TEColumnParallelLinear = None

    # megatron-core 0.16.x: multi-token prediction shifts packed (THD) tokens, labels and masks one sequence at a
    # time, slicing by cu_seqlens values on the host (a sync per sequence, four tensors per micro-batch). Without
    # context parallelism one roll and one scatter on the device give the same.
    from megatron.core.transformer import multi_token_prediction as mtp

    if getattr(mtp._roll_tensor_packed_seq, "__module__", "") == mtp.__name__:
        mtp._roll_tensor_packed_seq = partial(roll_packed_left, mtp._roll_tensor_packed_seq)

    # megatron-core 0.16.x: under full recompute an MTP layer hands all its keyword arguments to
    # tensor_parallel.checkpoint, which saves them for the backward; PackedSeqParams is no tensor, so packed runs fail
    # ("save_for_backward can only save variables"). Non-tensors are bound to the function instead.
    layer = mtp.MultiTokenPredictionLayer
    if not getattr(layer._checkpointed_forward, "binds_non_tensors", False):
        layer._checkpointed_forward = _bind_non_tensors(layer._checkpointed_forward)


def _bind_non_tensors(checkpointed_forward):
    import torch

    def wrapper(self, forward_func, **kwargs):
        fixed = {k: v for k, v in kwargs.items() if v is not None and not isinstance(v, torch.Tensor)}
        passed = [k for k in kwargs if k not in fixed]

        def bound(*values):
            return forward_func(**dict(zip(passed, values)), **fixed)

        return checkpointed_forward(self, bound, **{k: kwargs[k] for k in passed})

    wrapper.binds_non_tensors = True
    return wrapper


def roll_packed_left(megatron_roll, tensor, shifts, dims, packed_seq_params, cp_group=None):
    """Each packed sequence of ``tensor`` ([.., tokens]) moved one position left, its last position zeroed; (the
    result, its sum) as Megatron's ``_roll_tensor_packed_seq`` returns. Under context parallelism: Megatron's."""
    import torch

    if (cp_group is not None and cp_group.size() > 1) or shifts != -1 or dims not in (-1, tensor.dim() - 1):
        return megatron_roll(tensor, shifts, dims, packed_seq_params, cp_group)
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled[..., packed_seq_params.cu_seqlens_q[1:].long() - 1] = 0
    return rolled, rolled.sum()


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for apex's ``multi_tensor_l2norm`` (as Megatron calls it): the l2 norm of all tensors, fp32, [1]."""
    import torch

    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for apex's ``multi_tensor_scale``: dst = src * scale."""
    import torch

    sources, targets = tensor_lists
    if all(a is b for a, b in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))
