"""The native gated delta-rule layer against transformers' ``Qwen3NextGatedDeltaNet``, split over two tensor-parallel
ranks: Qwen3-Next's checkpoint tensors, each rank's slice read by the family's own ops, give transformers' outputs and
input gradients (padded), each sequence's own output when packed (the conv and the recurrent state restart at every
sequence), and on both ranks the whole gradient of the output norm shared by all heads (summed over the ranks).
Our torch delta rule (``delta_rule.py``) against transformers' ``torch_chunk_gated_delta_rule`` run per sequence, over
lengths that cross chunk boundaries, outputs and the gradients of all five inputs."""

import pytest
import torch

from tests._dist import run_distributed
from tests.models._delta_rule import transformers_rule_per_sequence


HIDDEN, NK, NV, DK, DV, KERNEL = 64, 2, 4, 8, 12, 4
LENGTHS = (10, 18, 2, 12)  # one sequence shorter than the convolution
HF_PREFIX = "model.layers.0.linear_attn."


def _hf_layer():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(_hf_config(Qwen3NextConfig), layer_idx=0).float().eval()
    with torch.no_grad():
        for param in (layer.dt_bias, layer.A_log, layer.norm.weight):
            param.add_(0.3 * torch.randn_like(param))
    return layer


def _hf_config(cls):
    return cls(hidden_size=HIDDEN, linear_num_key_heads=NK, linear_num_value_heads=NV, linear_key_head_dim=DK,
               linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, rms_norm_eps=1e-6, num_hidden_layers=1, layer_types=["linear_attention"],
               num_experts=2, moe_intermediate_size=8, shared_expert_intermediate_size=8)


def _ours(hf_tensors: dict, x_padded: torch.Tensor, x_packed: torch.Tensor) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from transformers import Qwen3NextConfig

    from llamafactory_mca import parallel
    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.models.loading import dims_for, local_targets
    from llamafactory_mca.models.mapping import DictSource, WeightTable
    from llamafactory_mca.models.native.gated_delta import NativeGatedDeltaNet

    parallel.initialize(parallel.ParallelLayout(world_size=2, tp=2, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=1,
                                                expert_dp=1, micro_batch_size=1, grad_accum=1))
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               layernorm_epsilon=1e-6, linear_num_key_heads=NK, linear_num_value_heads=NV,
                               linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL,
                               tensor_model_parallel_size=2)
    layer = NativeGatedDeltaNet(config)
    mca = get_family("qwen3_next").config_from_hf(_hf_config(Qwen3NextConfig))
    table, dims = WeightTable(get_family("qwen3_next").weights(mca)), dims_for(mca, 2)
    holder = torch.nn.Module()  # the layer where a model keeps it, so its names are the canonical ones
    holder.config = config
    holder.decoder = torch.nn.Module()
    holder.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.decoder.layers[0].layer_number = 1
    holder.decoder.layers[0].self_attention = layer
    with torch.no_grad():
        for target in local_targets(holder):
            op, names = table.lookup(target.canonical)
            target.assign(op.load(DictSource(hf_tensors), names, target.shard, dims))
    out = {"rank": ps.get_tensor_model_parallel_rank()}
    x = x_padded.transpose(0, 1).clone().requires_grad_(True)  # [s, b, h]
    y, _ = layer(x)
    y.square().sum().backward()
    out["padded"], out["padded_grad"] = y.transpose(0, 1).detach(), x.grad.transpose(0, 1)
    out["norm_grad"], out["A_log_grad"] = layer.out_norm.weight.grad.clone(), layer.A_log.grad.clone()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                             max_seqlen_kv=max(LENGTHS))
    with torch.no_grad():
        y, _ = layer(x_packed.transpose(0, 1), packed_seq_params=params)  # [t, 1, h]
    out["packed"] = y.transpose(0, 1)
    parallel.destroy_layout()
    return out


def test_native_gated_delta_net_is_transformers_over_tp2():
    hf = _hf_layer()
    g = torch.Generator().manual_seed(1)
    x_padded = torch.randn(2, 24, HIDDEN, generator=g)
    x_packed = torch.randn(1, sum(LENGTHS), HIDDEN, generator=g)
    tensors = {HF_PREFIX + name: p.detach().clone() for name, p in hf.named_parameters()}
    ranks = run_distributed(_ours, 2, tensors, x_padded, x_packed)
    x = x_padded.clone().requires_grad_(True)
    want = hf(x)
    want.square().sum().backward()
    with torch.no_grad():
        per_sequence = torch.cat([hf(piece) for piece in torch.split(x_packed, list(LENGTHS), dim=1)], dim=1)
        whole = hf(x_packed)
    for ours in ranks:
        assert torch.allclose(ours["padded"], want.detach(), atol=1e-5, rtol=1e-4), (ours["padded"] - want).abs().max()
        assert torch.allclose(ours["padded_grad"], x.grad, atol=1e-4, rtol=1e-4), (ours["padded_grad"] - x.grad).abs()
        assert torch.allclose(ours["packed"], per_sequence, atol=1e-5, rtol=1e-4), (ours["packed"] - per_sequence)
        # shared by every head: the whole gradient on each rank (summed over TP), not the rank's heads' share
        assert torch.allclose(ours["norm_grad"], hf.norm.weight.grad, atol=1e-4, rtol=1e-4)
        half = NV // 2  # the rank's value heads
        own = hf.A_log.grad[ours["rank"] * half:(ours["rank"] + 1) * half]
        assert torch.allclose(ours["A_log_grad"], own, atol=1e-4, rtol=1e-4)
    # the state restarts: one forward over the whole pack (transformers does not restart) differs
    assert not torch.allclose(whole, per_sequence, atol=1e-3)


@pytest.mark.parametrize("rows,lengths", [(2, (150, 150)), (1, (1, 64, 65, 130, 3, 70)), (3, (7, 7, 7))],
                         ids=["padded-rows", "packed-ragged", "short-rows"])
def test_our_delta_rule_is_transformers_per_sequence(rows, lengths):
    from llamafactory_mca.models.native.delta_rule import chunked_delta_rule

    g = torch.Generator().manual_seed(0)
    total = sum(lengths) // rows
    shapes = [(NK, DK), (NK, DK), (NV, DV), (NV,), (NV,)]
    inputs = [torch.randn(rows, total, *shape, generator=g, dtype=torch.float64) for shape in shapes]
    inputs[3] = -0.5 * inputs[3].abs()  # log decay
    inputs[4] = inputs[4].sigmoid()  # beta
    leaves = [t.requires_grad_(True) for t in inputs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if rows == 1 else None
    ours = chunked_delta_rule(*(t.float() for t in leaves), cu_seqlens=cu)
    want = transformers_rule_per_sequence(*leaves, cu.tolist() if cu is not None else [0, total])
    weight = torch.randn(ours.shape, generator=g)
    mine = torch.autograd.grad((ours * weight).sum(), leaves)
    theirs = torch.autograd.grad((want * weight).sum(), leaves)
    assert torch.allclose(ours, want, atol=1e-5), (ours - want).abs().max()
    for name, a, b in zip(("q", "k", "v", "g", "beta"), mine, theirs):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (name, (a - b).abs().max())
