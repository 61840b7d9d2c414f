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


def test_param_remainders_follow_fused_adam_on_fp32_masters_bit_for_bit():
    """``store_param_remainders`` on CUDA: the masters rebuilt from bf16 weights and remainders are those of torch's
    fused AdamW on fp32 masters (the plain path's kernel), step after step."""
    from llamafactory_mca.trainer.param_remainders import RemainderAdamW, join

    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen).to(torch.bfloat16).float().cuda() for n in (3 << 20, 4099)]
    reference = [torch.nn.Parameter(m.clone()) for m in masters]
    ours = [m.to(torch.bfloat16) for m in masters]
    kwargs = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference, fused=True, **kwargs)
    opt = RemainderAdamW(ours, **kwargs)
    for p in ours:
        opt.initialize_state(p)
    for _ in range(3):
        for ref, p in zip(reference, ours):
            g = torch.randn(ref.shape, generator=gen).cuda()
            ref.grad, p.decoupled_grad = g.clone(), g.clone()
        ref_opt.step()
        opt.step()
    for ref, p in zip(reference, ours):
        assert torch.equal(join(p, opt.state[p]["master_param"]).view(torch.int32), ref.detach().view(torch.int32))
        assert opt.state[p]["step"].device.type == "cuda"


@pytest.mark.parametrize("moments", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_one_pass_step_is_the_chunked_step(moments):
    """Moments kept narrower than fp32: the one-pass Triton step equals torch's fused Adam on the widened moments and
    the rebuilt master (the chunked path), up to the rounding of a differently fused fp32 expression."""
    from llamafactory_mca.trainer.param_remainders import RemainderAdamW, join

    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen).to(torch.bfloat16).cuda() for n in (3 << 20, 4099)]
    kwargs = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, exp_avg_dtype=moments[0],
                  exp_avg_sq_dtype=moments[1])
    runs = []
    for one_pass in (True, False):
        params = [p.clone() for p in start]
        opt = RemainderAdamW(params, **kwargs)
        opt._one_pass = one_pass  # False: the chunked path the CPU runs, here on CUDA
        for p in params:
            opt.initialize_state(p)
        steps = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.decoupled_grad = torch.randn(p.shape, generator=steps).cuda()
            opt.step()
        runs.append((params, opt))
    (fast, fast_opt), (slow, slow_opt) = runs
    for p, q in zip(fast, slow):
        a, b = join(p, fast_opt.state[p]["master_param"]), join(q, slow_opt.state[q]["master_param"])
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = fast_opt.state[p][key].float(), slow_opt.state[q][key].float()
            assert fast_opt.state[p][key].dtype == kwargs[f"{key}_dtype"]
            assert (x - y).abs().max() <= 1e-2 * y.abs().max()
        assert float(fast_opt.state[p]["step"]) == 3.0
