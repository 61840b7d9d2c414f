"""Megatron's training step on CPU: DDP + distributed optimizer with both overlaps, gloo DP2."""

import torch

from tests._dist import run_distributed


def _train_dp2() -> list[float]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from llamafactory_mca import parallel
    from llamafactory_mca.cpu_mode import is_active

    layout = parallel.ParallelLayout(world_size=2, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=2, expert_dp=2,
                                     micro_batch_size=2, grad_accum=2)
    parallel.initialize(layout, seed=7)
    assert is_active()
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               gradient_accumulation_fusion=False, bias_activation_fusion=False,
                               masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True, overlap_param_gather=True)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, use_distributed_optimizer=True), [model])
    config.no_sync_func, config.grad_sync_func = model.no_sync, model.start_grad_sync
    config.param_sync_func, config.finalize_model_grads_func = model.start_param_sync, finalize_model_grads

    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]

    def forward_step(it, m):
        tokens = next(it)
        output = m(tokens, torch.arange(16).expand(2, -1), None, labels=tokens)
        return output, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

    losses = []
    for _ in range(8):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                                          num_microbatches=2, seq_length=16, micro_batch_size=2)
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
        losses.append(float(sum(o["loss"] for o in out) / len(out)))
    return losses


def test_dp2_distributed_optimizer_with_overlap_trains_on_cpu():
    per_rank = run_distributed(_train_dp2, 2)
    for losses in per_rank:
        assert losses[-1] < losses[0] * 0.9, losses
