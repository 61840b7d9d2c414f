"""torch's AdamW inside Megatron's optimizer wrappers: fused on CPU and CUDA, the same updates as the default one;
the loss's token division and the clipping folded into it, the same step as Megatron's own.

The CUDA half runs in ``tests/gpu`` on a machine with a GPU (it needs the fused CUDA kernel); both use the optimizer
pair of ``tests/_optim.py``.
"""

from types import SimpleNamespace

import torch

from llamafactory_mca.trainer.optim import step_counter, use_fused_adam
from tests._dist import run_distributed
from tests._optim import switch_and_train


def test_cpu_groups_run_fused_and_update_alike():
    inner, wrapper, ours = switch_and_train("cpu", rtol=1e-6, atol=1e-7)
    assert all(g["fused"] is True and g["foreach"] is False for g in inner.param_groups)
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


def _gpt_under_the_distributed_optimizer(clip: float, bf16: bool = False):
    """A 2-layer GPT model under Megatron's DDP and distributed optimizer (fused AdamW), seeded alike on every call."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(11)
    model_parallel_cuda_manual_seed(11)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               gradient_accumulation_fusion=False, bias_activation_fusion=False,
                               masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                               calculate_per_token_loss=True, bf16=bf16, params_dtype=dtype)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    if bf16:
        model = Float16Module(config, model)  # every parameter bf16, as Megatron-LM wraps its models
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, clip_grad=clip, weight_decay=0.1, bf16=bf16,
                                                       params_dtype=dtype, use_distributed_optimizer=True),
                                       [model])
    use_fused_adam(optimizer)
    config.finalize_model_grads_func = finalize_model_grads
    return config, model, optimizer


def _folded_and_megatrons_steps() -> list:
    """Two equal GPT models under DDP and the distributed optimizer, trained on per-token losses whose token counts
    differ by rank: one stepped by Megatron (finalize divides the gradients, clipping multiplies them), the other by
    ``OptimizerStep`` (both inside fused AdamW). Per clip setting: each step's two gradient norms and the final
    parameters' largest difference."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from llamafactory_mca import parallel
    from llamafactory_mca.trainer.optim import OptimizerStep, _fused_adams

    layout = parallel.ParallelLayout(world_size=2, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=2, expert_dp=2,
                                     micro_batch_size=2, grad_accum=2)
    parallel.initialize(layout, seed=7)
    rank = torch.distributed.get_rank()
    build = _gpt_under_the_distributed_optimizer

    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]
    masks = [(torch.rand(2, 16, generator=g) < (0.3 if rank else 0.9)).float() for _ in range(2)]

    def run(model, optimizer, step) -> float:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        data = iter(zip(batches, masks))

        def forward_step(it, m):
            tokens, mask = next(it)
            losses = m(tokens, torch.arange(16).expand(2, -1), None, labels=tokens)
            total = (losses.float() * mask).sum()
            return losses, lambda out: (total, mask.sum().to(torch.int), {"loss": total.detach()})

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=[model],
                                    num_microbatches=2, seq_length=16, micro_batch_size=2)
        ok, norm = step()
        assert ok
        return float(norm)

    results = []
    for clip in (0.05, 0.0):
        _, theirs, theirs_opt = build(clip)
        ours_config, ours, ours_opt = build(clip)
        folded = OptimizerStep(ours_opt, [ours], ours_config)
        assert _fused_adams(ours_opt) is not None
        norms = [(run(theirs, theirs_opt, lambda: theirs_opt.step()[:2]), run(ours, ours_opt, folded.step))
                 for _ in range(4)]
        gap = max(float((a - b).abs().max()) for a, b in zip(theirs.parameters(), ours.parameters()))
        results.append((clip, norms, gap))
    return results


def test_token_division_and_clipping_inside_adam_step_as_megatron_does():
    for clip, norms, gap in run_distributed(_folded_and_megatrons_steps, 2)[0]:
        for theirs, ours in norms:
            if clip:
                assert abs(theirs - ours) <= 1e-5 * theirs, norms
        if clip:
            assert norms[0][0] > 10 * clip, norms  # the clipping was active
        # 4 steps at lr 3e-3 move a parameter up to 1.2e-2; g / N and g * (1 / N) differ in the last bit, which
        # Adam's g / sqrt(v) carries into the update where v is tiny
        assert gap < 2e-5, (clip, gap)


def _weights_written_again() -> bool:
    """bf16 weights under the distributed optimizer at DP2, overwritten (as FP8's casts overwrite them during a step,
    ``fp8.casts_take_weights``), then written again without an update (``OptimizerStep.rewrite_weights``): each rank
    writes its shard from the fp32 main weights and gathers the other's."""
    from llamafactory_mca import parallel
    from llamafactory_mca.trainer.optim import OptimizerStep

    layout = parallel.ParallelLayout(world_size=2, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=2, expert_dp=2,
                                     micro_batch_size=2, grad_accum=1)
    parallel.initialize(layout, seed=7)
    config, model, optimizer = _gpt_under_the_distributed_optimizer(0.0, bf16=True)
    for param in model.parameters():  # main weights apart from the bf16 ones
        param.data.add_(torch.randn_like(param) * 1e-2)
    optimizer.reload_model_params()
    before = [param.detach().clone() for param in model.parameters()]
    assert all(param.dtype == torch.bfloat16 for param in before)
    for param in model.parameters():
        param.data.view(torch.int16).fill_(0x7F7F)  # not what the main weights hold
    OptimizerStep(optimizer, [model], config).rewrite_weights()
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_weights_lent_for_a_step_are_written_again_from_the_main_weights():
    assert run_distributed(_weights_written_again, 2) == [True, True]
