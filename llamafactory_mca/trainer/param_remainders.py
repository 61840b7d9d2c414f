"""Adam whose fp32 master weights are the bf16 weights plus a 16-bit remainder: 16 bytes per parameter, not 18.

Megatron's distributed optimizer keeps an fp32 copy of every bf16 weight (with the fp32 gradient and Adam's two
moments: 18 bytes per parameter; LLaMA-Factory's fp32 weights under autocast hold 16). The copy's upper 16 bits are
the bf16 weight, so only the lower 16 need keeping. Transformer Engine's FusedAdam does this
(``store_param_remainders``), and megatron-core hands such an optimizer the bf16 shards themselves, with the fp32
gradients beside them as ``decoupled_grad`` (its "precision-aware" mode). ``RemainderAdamW`` is that optimizer
without Transformer Engine: each step rebuilds the fp32 master a chunk at a time, runs torch's own Adam on it (the
kernel the plain path runs: fused on CUDA), and splits it back. The master weights therefore follow the
fp32-master path exactly. The bf16 weight is the master rounded half away from zero (torch's cast rounds half to
even), so the two differ by one bf16 step where the lower 16 bits are exactly 0x8000 (one value in 65,536).

Moments may be kept in bf16 too (``exp_avg_dtype`` / ``exp_avg_sq_dtype``, Megatron's keys): 12 bytes per parameter.
Their step is one Triton kernel on GPUs (``adam_triton.py``); elsewhere the chunk's moments are widened to fp32 around
the same torch Adam and rounded back.

Checkpoints hold fp32 masters and moments whatever is kept (``get_unscaled_state``): every mode resumes the others'.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import megatron.core.optimizer as megatron_optimizer
import torch
from torch.optim.adam import adam

from . import adam_triton


CHUNK = 1 << 25  # elements rebuilt in fp32 at a time: 128 MiB of temporaries per tensor, whatever the model's size
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # exp_avg(_sq)_dtype: args.MOMENT_DTYPES as torch's
_HALF = 1 << 15
_SHIFT = 1 << 16


def join(low: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """The fp32 master from its bf16 upper half and int16 remainder (a new tensor)."""
    return (_compiled_join() if low.is_cuda else _join)(low.view(torch.int16), rest)


def split(master: torch.Tensor, low: torch.Tensor, rest: torch.Tensor) -> None:
    """Write ``master`` (fp32) as its bf16 rounding into ``low`` and the int16 remainder into ``rest``.

    On the bit pattern: the upper half rounded half away from zero (for a negative value the pattern grows with the
    magnitude, and the sign bit stays), the remainder what is left, in [-2**15, 2**15)."""
    (_compiled_split() if master.is_cuda else _split)(master, low.view(torch.int16), rest)


def _join(high: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    return (high.to(torch.int32) * _SHIFT + rest.to(torch.int32)).view(torch.float32)


def _split(master: torch.Tensor, high: torch.Tensor, rest: torch.Tensor) -> None:
    bits = master.view(torch.int32)
    rounded = torch.div(bits + _HALF, _SHIFT, rounding_mode="floor")
    rest.copy_(bits - rounded * _SHIFT)
    high.copy_(rounded)


# Integer arithmetic, exact in any kernel; compiled, each is one pass over memory instead of four or five (the step's
# cost beside the fused Adam kernel). Chunks differ in length: one graph for all of them.
@functools.cache
def _compiled_join():
    return torch.compile(_join, fullgraph=True, dynamic=True)


@functools.cache
def _compiled_split():
    return torch.compile(_split, fullgraph=True, dynamic=True)


def _chunks(numel: int) -> Iterator[slice]:
    for start in range(0, numel, CHUNK):
        yield slice(start, min(start + CHUNK, numel))


class RemainderAdamW(torch.optim.AdamW):
    """AdamW over bf16 (and fp32) parameter shards with fp32 gradients in ``param.decoupled_grad``.

    The interface megatron-core's distributed optimizer expects of Transformer Engine's FusedAdam in precision-aware
    mode: ``initialize_state``, ``get_unscaled_state`` and ``set_scaled_state``, the state keys ``exp_avg``,
    ``exp_avg_sq`` and ``master_param`` (here the int16 remainder of a bf16 parameter; of an fp32 parameter, an empty
    placeholder: the parameter is its own master). A torch AdamW (megatron-core checks the class) whose step counter
    is kept per parameter as torch keeps it (megatron-core without Transformer Engine reads it there).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adam_w_mode: bool = True, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 master_weight_dtype=torch.float32, master_weights: bool = True, use_decoupled_grad: bool = True,
                 store_param_remainders: bool = True) -> None:
        for name, dtype, kept in (("exp_avg_dtype", exp_avg_dtype, tuple(MOMENT_DTYPES.values())),
                                  ("exp_avg_sq_dtype", exp_avg_sq_dtype, tuple(MOMENT_DTYPES.values())),
                                  ("master_weight_dtype", master_weight_dtype, (torch.float32,))):
            if dtype not in kept:
                raise ValueError(f"{name}={dtype}: only {', '.join(map(str, kept))} is kept here")
        if not (master_weights and use_decoupled_grad and store_param_remainders):
            raise ValueError("RemainderAdamW keeps fp32 masters as remainders of bf16 parameters only")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adam_w_mode = adam_w_mode  # not a group key: a checkpoint's groups replace ours on load
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        # fp32 moments keep torch's own Adam: the masters then follow the plain path's bit for bit
        self._one_pass = exp_avg_dtype != torch.float32 or exp_avg_sq_dtype != torch.float32

    # ---- state ------------------------------------------------------------------------------------------------------

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = True) -> None:
        """Zero moments; the master equals the parameter (remainder 0)."""
        state = self.state[param]
        for name, dtype in self.moment_dtypes.items():
            state[name] = torch.zeros_like(param, dtype=dtype)
        state["master_param"] = self._empty_master(param)
        if "step" not in state:
            state["step"] = self._counter(param, 0.0)

    @staticmethod
    def _empty_master(param: torch.Tensor) -> torch.Tensor:
        if param.dtype == torch.bfloat16:
            return torch.zeros_like(param, dtype=torch.int16)
        return torch.empty(0, dtype=torch.int16, device=param.device)

    @staticmethod
    def _counter(param: torch.Tensor, value: float) -> torch.Tensor:
        """On the parameter's device where the fused kernel reads it (CUDA), a CPU scalar elsewhere (torch's rule)."""
        return torch.tensor(value, dtype=torch.float32, device=param.device if param.is_cuda else "cpu")

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """fp32 state as a checkpoint holds it. A bf16 parameter's master is rebuilt a chunk at a time into host
        memory: a save (or a load, which reads into these tensors) holds every master at once, and 4 bytes per
        parameter more on the GPU could fail a run that trains within its memory."""
        state = self.state[param]
        if state_name != "master_param":
            kept = state[state_name]
            # moments kept in bf16 are saved widened, in host memory for the reason above
            return kept if kept.dtype == torch.float32 else kept.to("cpu").float()
        if param.dtype != torch.bfloat16:
            return param.detach()
        master = torch.empty(param.shape, dtype=torch.float32, device="cpu")
        flat, low, rest = master.view(-1), param.detach().view(-1), state["master_param"].view(-1)
        for part in _chunks(param.numel()):
            flat[part].copy_(join(low[part], rest[part]))
        return master

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Take fp32 state from a checkpoint; a master sets the bf16 parameter too (rounded as the step rounds)."""
        if not torch.is_tensor(unscaled_state):  # a bucket entry's "padding" flag, handed over with its tensors
            return
        state = self.state[param]
        if state_name == "step":  # saved beside the moments; kept where the kernel reads it
            state["step"] = self._counter(param, float(unscaled_state))
            return
        value = unscaled_state.to(param.device, torch.float32).view(param.shape)
        if state_name == "master_param":
            if param.dtype != torch.bfloat16:
                param.data.copy_(value)
                state["master_param"] = self._empty_master(param)
                return
            if state.get("master_param") is None or state["master_param"].shape != param.shape:
                state["master_param"] = self._empty_master(param)
            split(value.contiguous(), param.data, state["master_param"])
        else:
            dtype = self.moment_dtypes.get(state_name, torch.float32)
            if state_name not in state or state[state_name].dtype != dtype:
                state[state_name] = torch.empty_like(param, dtype=dtype)
            state[state_name].copy_(value)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts floating state to the parameter's dtype (bf16 here): the moments keep the dtype they
        were saved in, the remainder stays int16."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value) and key != "step":
                    self.state[param][key] = value.to(param.device)

    # ---- the step ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None)
                if grad is None:
                    grad = param.grad
                if grad is None:
                    continue
                state = self.state[param]
                if "exp_avg" not in state:
                    self.initialize_state(param)
                step = state["step"]
                if param.is_cuda and not step.is_cuda:  # a counter a checkpoint load or torch's rule put on the CPU
                    state["step"] = step = step.to(param.device, torch.float32)
                if self._one_pass and param.is_cuda and param.dtype == torch.bfloat16:
                    adam_triton.adamw_step(param.data.view(-1), state["master_param"].view(-1), grad.view(-1),
                                           state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1), step,
                                           lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                           weight_decay=group["weight_decay"], decoupled=self.adam_w_mode)
                else:
                    for part in _chunks(param.numel()):
                        self._chunk_step(param, grad, state, part, group)
                step.add_(1)
        return loss

    def _chunk_step(self, param: torch.Tensor, grad: torch.Tensor, state: dict, part: slice, group: dict) -> None:
        """torch's Adam on one chunk's fp32 master, rebuilt and split back; moments kept narrower are widened around
        it and rounded back."""
        beta1, beta2 = group["betas"]
        low = param.data.view(-1)[part]
        master = join(low, state["master_param"].view(-1)[part]) if param.dtype == torch.bfloat16 else low
        kept = [state[name].view(-1)[part] for name in ("exp_avg", "exp_avg_sq")]
        moments = [m if m.dtype == torch.float32 else m.float() for m in kept]
        adam([master], [grad.view(-1)[part].to(torch.float32)], moments[:1], moments[1:], [], [state["step"].clone()],
             foreach=False, fused=param.is_cuda, decoupled_weight_decay=self.adam_w_mode, amsgrad=False,
             beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=False)
        for narrow, wide in zip(kept, moments):
            if narrow is not wide:
                narrow.copy_(wide)
        if param.dtype == torch.bfloat16:
            split(master, low, state["master_param"].view(-1)[part])


@contextlib.contextmanager
def megatron_builds_remainder_adam() -> Iterator[None]:
    """While ``get_megatron_optimizer`` runs: its Adam is ours, in precision-aware mode.

    megatron-core chooses its Adam when it is imported (Transformer Engine's, apex's, else torch's) and asks
    Transformer Engine's version for the remainder flag; without either library it builds torch's AdamW, which has no
    precision-aware mode. The three names are restored afterwards.
    """
    names = ("Adam", "USING_PYTORCH_OPTIMIZER", "is_te_min_version")
    saved = {name: getattr(megatron_optimizer, name) for name in names}
    megatron_optimizer.Adam = RemainderAdamW
    megatron_optimizer.USING_PYTORCH_OPTIMIZER = False
    megatron_optimizer.is_te_min_version = lambda *args, **kwargs: True
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(megatron_optimizer, name, value)


def precision_aware(config, exp_avg_dtype: torch.dtype = torch.float32,
                    exp_avg_sq_dtype: torch.dtype = torch.float32) -> None:
    """Turn a built ``OptimizerConfig`` to precision-aware mode with remainders and the moments' dtypes (its own
    check wants Transformer Engine's FusedAdam, so the flags are set after it ran)."""
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.store_param_remainders = True
    config.exp_avg_dtype, config.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
