"""Fused AdamW on CUDA: the same updates as torch's default implementation, counters where the kernel wants them.

Run: ``python -m pytest tests/gpu -q`` (skipped without CUDA).
"""

import pytest
import torch

from llamafactory_mca.trainer.optim import use_fused_adam
from tests._optim import adam_pair, assert_same, step_both, switch_and_train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_fused_adam_on_cuda_matches_default():
    inner, _, ours = switch_and_train("cuda", rtol=1e-5, atol=1e-6)
    assert all(g["fused"] is True and g["foreach"] is False for g in inner.param_groups)
    assert all(inner.state[p]["step"].device.type == "cuda" for p in ours)


def test_loaded_cpu_counters_move_to_the_device():
    """A Megatron load hands torch CPU step counters and the saved group flags; the fused kernel needs them on
    the parameter's device, or its first step fails."""
    reference, inner, wrapper, ref, ours, gen = adam_pair("cuda")
    step_both(reference, inner, ref, ours, gen, steps=2)  # default (foreach): CPU counters
    assert inner.state[ours[0]]["step"].device.type == "cpu"
    use_fused_adam(wrapper)
    assert all(inner.state[p]["step"].device.type == "cuda" and float(inner.state[p]["step"]) == 2.0 for p in ours)
    step_both(reference, inner, ref, ours, gen, steps=2)
    assert_same(ref, ours, rtol=1e-5, atol=1e-6)
