"""torch's AdamW inside Megatron's optimizer wrappers: fused on CUDA, untouched on CPU, same updates either way.

The CUDA half runs in ``tests/gpu`` on a machine with a GPU (it needs the fused CUDA kernel); both use the optimizer
pair of ``tests/_optim.py``.
"""

from types import SimpleNamespace

import torch

from llamafactory_mca.trainer.optim import step_counter, use_fused_adam
from tests._optim import switch_and_train


def test_cpu_groups_keep_the_default_and_update_alike():
    inner, wrapper, ours = switch_and_train("cpu", rtol=0, atol=0)
    assert all(g["fused"] is None and g["foreach"] is None for g in inner.param_groups)
    counters = [inner.state[p]["step"] for p in ours]
    assert all(c.device.type == "cpu" and float(c) == 3.0 for c in counters)
    use_fused_adam(wrapper)  # after a checkpoint load: counters keep their value and place
    assert [float(inner.state[p]["step"]) for p in ours] == [3.0] * len(ours)


def test_step_counter_placement():
    cpu_param = torch.zeros(2)
    assert step_counter({"params": [cpu_param]}, 4).device.type == "cpu"
    counter = step_counter({"params": [cpu_param], "fused": True}, 4)
    assert counter.dtype == torch.float32 and float(counter) == 4.0


def test_non_finite_gradients_are_found_without_buffer_sized_temporaries(tmp_path):
    """The step is skipped when any gradient is NaN or inf (the check sums each buffer on the device)."""
    import torch.distributed as dist

    from llamafactory_mca.trainer.trainer import McaTrainer

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        def trainer(*grads):
            buffers = [SimpleNamespace(grad_data=g) for g in grads]
            return SimpleNamespace(device=torch.device("cpu"),
                                   wrapped=[SimpleNamespace(buffers=buffers[:1], expert_parallel_buffers=buffers[1:])])

        finite = torch.randn(1000)
        assert McaTrainer._grads_finite(trainer(finite, torch.randn(10)))
        for bad in (float("nan"), float("inf"), -float("inf")):
            experts = torch.randn(10)
            experts[3] = bad
            assert not McaTrainer._grads_finite(trainer(finite, experts))
        both = torch.zeros(4)
        both[0], both[1] = float("inf"), -float("inf")
        assert not McaTrainer._grads_finite(trainer(both))
    finally:
        if created:
            dist.destroy_process_group()


def test_grad_norm_and_clip_are_megatrons_without_per_tensor_syncs():
    """The foreach replacements for Megatron's apex-less fallbacks give its values (compat.apply_megatron_fixes)."""
    from megatron.core.utils import local_multi_tensor_scale

    from llamafactory_mca.compat import foreach_l2_norm, foreach_scale

    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=gen) for s in ((64, 32), (32,), (7, 5))] + [torch.randn(9).bfloat16()]
    ours, _ = foreach_l2_norm(0, None, [grads], False)
    # local_multi_tensor_l2_norm's sum of per-tensor norms, here in float64 (it takes each norm in the tensor's dtype)
    theirs = torch.norm(torch.tensor([float(torch.norm(g.double())) for g in grads], dtype=torch.float64))
    assert ours.shape == (1,) and ours.dtype == torch.float32
    torch.testing.assert_close(ours[0].double(), theirs, rtol=1e-6, atol=0)
    expected = [g * 0.25 for g in grads]
    copies = [torch.empty_like(g) for g in grads]
    foreach_scale(0, None, [grads, copies], 0.25)
    foreach_scale(0, None, [grads, grads], 0.25)  # in place, as clip_grad_by_total_norm_fp32 calls it
    for a, b, c in zip(grads, copies, expected):
        assert torch.equal(a, c) and torch.equal(b, c)
    reference = [g.clone() for g in grads]
    local_multi_tensor_scale(0, None, [reference, reference], 2.0)
    foreach_scale(0, None, [grads, grads], 2.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
