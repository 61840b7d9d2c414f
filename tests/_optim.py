"""Two AdamW stepped side by side, torch's default one and one behind a Megatron-like wrapper that ``use_fused_adam``
switches: the CPU test (tests/test_optim.py) and the CUDA one (tests/gpu/test_optim_gpu.py) hold them to the same
updates."""

from types import SimpleNamespace

import torch

from llamafactory_mca.trainer.optim import use_fused_adam


def adam_pair(device: str, dtype: torch.dtype = torch.float32):
    """Two AdamW over equal parameters, the second behind a Megatron-like wrapper, with equal gradients."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (7, 5)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    reference = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:], "weight_decay": 0.0}], **kwargs)
    inner = torch.optim.AdamW([{"params": ours[:2]}, {"params": ours[2:], "weight_decay": 0.0}], **kwargs)
    wrapper = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])
    return reference, inner, wrapper, ref, ours, gen


def step_both(reference, inner, ref, ours, gen, steps: int = 3) -> None:
    for _ in range(steps):
        for a, b in zip(ref, ours):
            g = torch.randn(a.shape, generator=gen).to(a.device, a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        reference.step()
        inner.step()


def assert_same(ref, ours, rtol: float, atol: float) -> None:
    for a, b in zip(ref, ours):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def switch_and_train(device: str, rtol: float, atol: float):
    """``use_fused_adam`` on a fresh optimizer, three steps: the parameters equal torch's default AdamW's."""
    reference, inner, wrapper, ref, ours, gen = adam_pair(device)
    use_fused_adam(wrapper)
    step_both(reference, inner, ref, ours, gen)
    assert_same(ref, ours, rtol, atol)
    return inner, wrapper, ours
