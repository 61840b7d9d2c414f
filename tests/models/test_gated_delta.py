"""The native gated delta-rule layer (issue 19's first piece) against transformers' ``Qwen3NextGatedDeltaNet``:
the same weights (Qwen3-Next's per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` regrouped into Megatron's
[q | k | v | z | beta | alpha] rows) give the same outputs and input gradients, padded, and packed with the state
restarting at every sequence (against transformers run on each sequence alone)."""

import torch

from tests._dist import run_distributed

HIDDEN, NK, NV, DK, DV, KERNEL = 64, 2, 4, 8, 8, 4
LENGTHS = (10, 18, 12)


def _hf_layer():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(0)
    config = Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=NK, linear_num_value_heads=NV,
                             linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0).float().eval()
    with torch.no_grad():
        for param in (layer.dt_bias, layer.A_log, layer.norm.weight):
            param.add_(0.3 * torch.randn_like(param))
    return layer


def _regrouped(layer) -> dict[str, torch.Tensor]:
    """transformers' per-key-head projections as Megatron's flat rows."""
    r = NV // NK
    qkvz = layer.in_proj_qkvz.weight.view(NK, 2 * DK + 2 * r * DV, HIDDEN)
    q, k, v, z = torch.split(qkvz, [DK, DK, r * DV, r * DV], dim=1)
    b, a = torch.split(layer.in_proj_ba.weight.view(NK, 2 * r, HIDDEN), [r, r], dim=1)
    rows = [t.reshape(-1, HIDDEN) for t in (q, k, v, z, b, a)]
    return {"in_proj.weight": torch.cat(rows), "conv1d": layer.conv1d.weight, "dt_bias": layer.dt_bias,
            "A_log": layer.A_log, "out_norm.weight": layer.norm.weight, "out_proj.weight": layer.out_proj.weight}


def _ours(weights: dict, x_padded: torch.Tensor, x_packed: torch.Tensor) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig

    from llamafactory_mca import parallel
    from llamafactory_mca.models.native.gated_delta import NativeGatedDeltaNet

    parallel.initialize(parallel.ParallelLayout(world_size=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=1,
                                                expert_dp=1, micro_batch_size=1, grad_accum=1))
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               layernorm_epsilon=1e-6, linear_num_key_heads=NK, linear_num_value_heads=NV,
                               linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL)
    layer = NativeGatedDeltaNet(config)
    assert sorted(n for n, _ in layer.named_parameters()) == sorted(weights)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(weights[name])
    out = {}
    x = x_padded.transpose(0, 1).clone().requires_grad_(True)  # [s, b, h]
    y, _ = layer(x)
    y.square().sum().backward()
    out["padded"], out["padded_grad"] = y.transpose(0, 1).detach(), x.grad.transpose(0, 1)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                             max_seqlen_kv=max(LENGTHS))
    y, _ = layer(x_packed.transpose(0, 1), packed_seq_params=params)  # [t, 1, h]
    out["packed"] = y.transpose(0, 1).detach()
    parallel.destroy_layout()
    return out


def test_native_gated_delta_net_is_transformers():
    hf = _hf_layer()
    g = torch.Generator().manual_seed(1)
    x_padded = torch.randn(2, 24, HIDDEN, generator=g)
    x_packed = torch.randn(1, sum(LENGTHS), HIDDEN, generator=g)
    (ours,) = run_distributed(_ours, 1, {k: v.detach().clone() for k, v in _regrouped(hf).items()}, x_padded,
                              x_packed)
    x = x_padded.clone().requires_grad_(True)
    want = hf(x)
    want.square().sum().backward()
    assert torch.allclose(ours["padded"], want.detach(), atol=1e-5, rtol=1e-4), (ours["padded"] - want).abs().max()
    grad_diff = (ours["padded_grad"] - x.grad).abs().max()
    assert torch.allclose(ours["padded_grad"], x.grad, atol=1e-4, rtol=1e-4), grad_diff
    with torch.no_grad():
        pieces = torch.split(x_packed, list(LENGTHS), dim=1)
        per_sequence = torch.cat([hf(piece) for piece in pieces], dim=1)
        diff = (ours["packed"] - per_sequence).abs().max()
        assert torch.allclose(ours["packed"], per_sequence, atol=1e-5, rtol=1e-4), diff
        # the state restarts: one forward over the whole pack (transformers does not restart) differs
        assert not torch.allclose(hf(x_packed), per_sequence, atol=1e-3)
