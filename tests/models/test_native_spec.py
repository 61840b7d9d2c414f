"""The native layer spec on CPU (fp32, gloo): parity with Megatron's local spec, packing, CP2, TP2+SP, EP2.

One single-process run builds the references (and checks what needs no second rank); it saves the
reference models as Megatron dist checkpoints, which the two-process runs load into their own layouts —
so those runs also exercise the native modules' sharded state dicts (grouped experts reading a
SequentialMLP checkpoint included).
"""

import copy
import dataclasses
import itertools
import logging
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed


VOCAB, SEQ, BATCH = 128, 16, 2
THD_LENGTHS = (8, 12, 4, 8)  # each a multiple of 2·cp for cp=2
TOL = dict(atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- helpers (run in the workers)


def _layout(world=1, tp=1, cp=1, ep=1):
    from llamafactory_mca.parallel import ParallelLayout

    return ParallelLayout(world_size=world, tp=tp, pp=1, vpp=None, cp=cp, ep=ep, etp=1, dp=world // (tp * cp),
                          expert_dp=world // ep, micro_batch_size=1, grad_accum=1)


def _config(moe=False, grouped=True, tp=1, cp=1, ep=1, sp=False, backend=None):
    from megatron.core.transformer import TransformerConfig

    from llamafactory_mca.models import spec

    kwargs = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
        normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=True,  # the guide recipe's value: our fused RoPE without TE
        tensor_model_parallel_size=tp, context_parallel_size=cp, expert_model_parallel_size=ep, sequence_parallel=sp,
    )
    if moe:
        kwargs.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=grouped,
                      moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", moe_aux_loss_coeff=0.0)
    if backend:
        kwargs["attention_backend"] = backend
    spec.prepare_config(kwargs)
    return spec.prepare_config(TransformerConfig(**kwargs))


def _model(config, block=False):
    from megatron.core.models.gpt import GPTModel

    from llamafactory_mca.models import spec

    layer_spec = spec.get_block_spec(config) if block else spec.get_layer_spec(config)
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)  # Megatron pins them per backend; this process builds local and native models
    return GPTModel(config, layer_spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope",
                    rotary_base=10000)


def _inputs():
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    packed = torch.randint(0, VOCAB, (1, sum(THD_LENGTHS)), generator=g)
    weights = torch.randn(BATCH, SEQ, VOCAB, generator=g)
    packed_weights = torch.randn(1, sum(THD_LENGTHS), VOCAB, generator=g)
    return tokens, packed, weights, packed_weights


def _cu_seqlens():
    return torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


def _thd_params(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _positions(tokens):
    return torch.arange(tokens.size(1)).expand(tokens.size(0), -1)


def _packed_positions(cu):
    return torch.cat([torch.arange(int(b - a)) for a, b in itertools.pairwise(cu)]).unsqueeze(0)


def _forward(model, tokens, packed_seq_params=None, positions=None):
    positions = _positions(tokens) if positions is None else positions
    return model(tokens, positions, None, packed_seq_params=packed_seq_params)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a, b):
    return float((a - b).abs().max())


def _rel_diff(a, b):
    """Largest difference relative to the largest magnitude (gradients here reach the hundreds)."""
    return _max_diff(a, b) / max(float(a.abs().max()), 1.0)


def _save(model, directory):
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def _load(model, directory):
    from megatron.core import dist_checkpointing

    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory), strict=False)


def _sequential_to_grouped(state: dict, num_experts: int) -> dict:
    """SequentialMLP expert weights → GroupedMLP weight1/weight2 (the layout GroupedMLP's forward views)."""
    out = {k: v for k, v in state.items() if ".local_experts." not in k}
    layers = sorted({k.split(".mlp.")[0] for k in state if ".local_experts." in k})
    for layer in layers:
        fc1 = [state[f"{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(num_experts)]
        fc2 = [state[f"{layer}.mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(num_experts)]
        out[f"{layer}.mlp.experts.weight1"] = torch.stack([w.t() for w in fc1]).reshape(fc1[0].size(1), -1)
        out[f"{layer}.mlp.experts.weight2"] = torch.stack([w.t() for w in fc2]).reshape(-1, fc2[0].size(0))
    return out


def _grouped_state(sequential_state: dict) -> dict:
    """A bare SequentialMLP's state dict as a bare GroupedMLP's."""
    prefixed = {f"x.mlp.experts.{k}": v for k, v in sequential_state.items()}
    return {k.removeprefix("x.mlp.experts."): v for k, v in _sequential_to_grouped(prefixed, 4).items()}


# ----------------------------------------------------------------------------- the single-process suite


def _single_process_suite(ckpt_dir: str) -> dict:
    from llamafactory_mca import parallel
    from llamafactory_mca.models.auto import AutoModel

    parallel.initialize(_layout(), seed=11)
    tokens, packed, weights, packed_weights = _inputs()
    cu = _cu_seqlens()
    res = {}

    # Native vs Megatron's local spec, same weights, padded batch: dense, MoE (sequential), MoE (grouped).
    for name, moe, grouped in (("dense", False, False), ("moe_sequential", True, False), ("moe_grouped", True, True)):
        torch.manual_seed(0)
        local = _model(_config(moe=moe, grouped=False, backend="local"))
        native = _model(_config(moe=moe, grouped=grouped))
        state = local.state_dict()
        if grouped:
            state = _sequential_to_grouped(state, 4)
        missing, _ = native.load_state_dict(state, strict=False)
        assert not [k for k in missing if "_extra_state" not in k], missing
        assert type(local.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
        a, b = _forward(local, tokens), _forward(native, tokens)
        (a * weights).sum().backward()
        (b * weights).sum().backward()
        res[f"parity_{name}_logits"] = _max_diff(a, b)
        ga, gb = _grads(local), _grads(native)
        res[f"parity_{name}_grads"] = max(_rel_diff(ga[k], gb[k]) for k in ga if k in gb)
        if moe:  # Megatron's alltoall dispatcher against ours (sync-free, all experts local)
            res[f"parity_{name}_dispatchers"] = tuple(type(m.decoder.layers[0].mlp.token_dispatcher).__name__
                                                      for m in (local, native))

    # The recipe key `moe_local_dispatch: false` keeps Megatron's dispatcher (through the real config build).
    from transformers import Qwen3MoeConfig

    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.training_args import TrainingArguments

    family = get_family("qwen3_moe")
    hf = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                        num_experts_per_tok=2, vocab_size=VOCAB)
    for value in (None, False):
        args = TrainingArguments(output_dir=ckpt_dir, moe_local_dispatch=value, moe_grouped_gemm=True)
        model = AutoModel.from_config(family.config_from_hf(hf), args)
        res[f"dispatch_key_{value}"] = type(model.chunks[0].decoder.layers[0].mlp.token_dispatcher).__name__

    # Packed THD == per-sequence forwards (dense and MoE), gradients too.
    for name, moe in (("dense", False), ("moe", True)):
        torch.manual_seed(1)
        model = _model(_config(moe=moe))
        out = _forward(model, packed, _thd_params(cu), _packed_positions(cu))
        (out * packed_weights).sum().backward()
        packed_grads = _grads(model)
        model.zero_grad()
        pieces = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            piece = _forward(model, packed[:, a:b])
            (piece * packed_weights[:, a:b]).sum().backward()
            pieces.append(piece)
        res[f"thd_{name}_logits"] = _max_diff(out, torch.cat(pieces, 1))
        per_seq = _grads(model)
        res[f"thd_{name}_grads"] = max(_rel_diff(packed_grads[k], per_seq[k]) for k in per_seq)

    # References for the multi-process runs, saved as dist checkpoints.
    torch.manual_seed(2)
    dense = _model(_config())
    _save(dense, f"{ckpt_dir}/dense")
    logits = _forward(dense, tokens)
    (logits * weights).sum().backward()
    res["ref_dense"] = {"logits": logits.detach(), "grads": _grads(dense)}
    dense.zero_grad()
    logits = _forward(dense, packed, _thd_params(cu), _packed_positions(cu))
    (logits * packed_weights).sum().backward()
    res["ref_dense_thd"] = {"logits": logits.detach(), "grads": _grads(dense)}

    torch.manual_seed(3)
    moe = _model(_config(moe=True, grouped=False))
    _save(moe, f"{ckpt_dir}/moe_sequential")
    logits = _forward(moe, tokens)
    (logits * weights).sum().backward()
    res["ref_moe"] = {"logits": logits.detach(), "grads": _grads(moe)}
    return res


# ----------------------------------------------------------------------------- the two-process runs


def _cp2_run(ckpt_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    from llamafactory_mca import parallel
    from llamafactory_mca.data.context_parallel import split_for_context_parallel

    parallel.initialize(_layout(world=2, cp=2), seed=11)
    rank, group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()
    model = _model(_config(cp=2))
    _load(model, f"{ckpt_dir}/dense")
    tokens, packed, weights, packed_weights = _inputs()
    out = {}

    local = split_for_context_parallel({"tokens": tokens, "positions": _positions(tokens), "weights": weights},
                                       None, rank, 2)
    logits = _forward(model, local["tokens"], positions=local["positions"])
    (logits * local["weights"]).sum().backward()
    out["padded"] = {"logits": logits.detach(), "grads": _all_reduced_grads(model, group)}

    model.zero_grad()
    cu = _cu_seqlens()
    local = split_for_context_parallel({"tokens": packed, "positions": _packed_positions(cu),
                                        "weights": packed_weights}, cu, rank, 2)
    logits = _forward(model, local["tokens"], _thd_params(cu), local["positions"])
    (logits * local["weights"]).sum().backward()
    out["thd"] = {"logits": logits.detach(), "grads": _all_reduced_grads(model, group)}
    return out


def _all_reduced_grads(model, group):
    grads = _grads(model)
    for g in grads.values():
        torch.distributed.all_reduce(g, group=group)
    return grads


def _tp2_sp_run(ckpt_dir: str) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from llamafactory_mca import parallel

    parallel.initialize(_layout(world=2, tp=2), seed=11)
    model = _model(_config(tp=2, sp=True), block=True)
    _load(model, f"{ckpt_dir}/dense")
    tokens, _, weights, _ = _inputs()
    logits = gather_from_tensor_model_parallel_region(_forward(model, tokens))
    (logits * weights).sum().backward()
    # What Megatron's finalize_model_grads does for these parameters (SP-marked norms, qk-norms by name).
    norms = {}
    for name, param in model.named_parameters():
        if getattr(param, "sequence_parallel", False) or "layernorm" in name:
            grad = param.grad.detach().clone()
            torch.distributed.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
            norms[name] = (grad, bool(getattr(param, "sequence_parallel", False)))
    return {"logits": logits.detach(), "norm_grads": norms}


def _ep2_run(ckpt_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    from llamafactory_mca import parallel

    parallel.initialize(_layout(world=2, ep=2), seed=11)
    model = _model(_config(moe=True, grouped=True, ep=2))
    experts = model.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "NativeGroupedMLP" and experts.num_local_experts == 2
    _load(model, f"{ckpt_dir}/moe_sequential")  # a SequentialMLP checkpoint into grouped experts
    tokens, _, weights, _ = _inputs()  # the same batch on both ranks: each must reproduce the reference
    logits = _forward(model, tokens)
    (logits * weights).sum().backward()
    assert type(model.decoder.layers[0].mlp.token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
    return {"logits": logits.detach(), "ep_rank": ps.get_expert_model_parallel_rank(),
            "weight1_grad": experts.weight1.grad.detach().clone(), "weight2_grad": experts.weight2.grad.clone()}


# ----------------------------------------------------------------------------- grouped experts vs loop


def _experts_suite() -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from llamafactory_mca import parallel
    from llamafactory_mca.models.native.experts import NativeGroupedMLP, grouped_mm_usable

    parallel.initialize(_layout(), seed=5)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    res = {}
    for name, ffn in (("grouped_mm", 32), ("loop_fallback", 5)):  # 5 fp32 columns: unaligned rows, loop
        config = _config(moe=True)
        config.moe_ffn_hidden_size = ffn
        torch.manual_seed(0)
        seq = SequentialMLP(4, config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                            pg_collection=pgs)
        grouped = NativeGroupedMLP(4, config, pg_collection=pgs)
        grouped.load_state_dict(_grouped_state(seq.state_dict()), strict=False)
        counts = torch.tensor([5, 0, 9, 3])
        g = torch.Generator().manual_seed(1)
        x = torch.randn(int(counts.sum()), 64, generator=g)
        probs = torch.rand(int(counts.sum()), generator=g)
        grad_out = torch.randn(int(counts.sum()), 64, generator=g)
        outs = {}
        for label, module in (("seq", seq), ("grouped", grouped)):
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            y, _ = module(xi, counts, pi)
            y.backward(grad_out)
            outs[label] = (y.detach(), xi.grad, pi.grad)
        res[f"{name}_used_kernel"] = grouped_mm_usable(x, grouped.weight1.view(4, 64, -1))
        res[f"{name}_out"] = _max_diff(outs["seq"][0], outs["grouped"][0])
        res[f"{name}_dx"] = _max_diff(outs["seq"][1], outs["grouped"][1])
        res[f"{name}_dprobs"] = _max_diff(outs["seq"][2], outs["grouped"][2])
        as_grouped = _grouped_state({k: v.grad for k, v in seq.named_parameters()})
        res[f"{name}_dw1"] = _max_diff(as_grouped["weight1"], grouped.weight1.grad)
        res[f"{name}_dw2"] = _max_diff(as_grouped["weight2"], grouped.weight2.grad)
        res[f"{name}_empty_expert_dw1"] = float(grouped.weight1.grad.view(4, 64, -1)[1].abs().max())
        if name == "grouped_mm":
            res.update(_into_main_grad(grouped, x, counts, probs, grad_out, pgs))
    res.update(_biased_experts(pgs))
    return res


def _biased_experts(pgs) -> dict:
    """gpt-oss's experts: biases on both projections and the clamped SwiGLU (quick_gelu, up + 1, limit 7), grouped
    against the per-expert arithmetic written out (transformers' GptOssExperts, its weights laid out as Megatron's).
    Megatron's SequentialMLP cannot be the reference: its biased MLP adds in place to an autograd view."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from llamafactory_mca.models.native.experts import NativeGroupedMLP

    config = _config(moe=True)
    config.add_bias_linear, config.activation_func = True, quick_gelu
    config.glu_linear_offset, config.activation_func_clamp_value = 1.0, 7.0
    grouped = NativeGroupedMLP(4, config, pg_collection=pgs)
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(4, 64, 64, generator=g) * 0.4, torch.randn(4, 32, 64, generator=g) * 0.2  # [E, in, out]
    b1, b2 = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    grouped.load_state_dict({"weight1": w1.reshape(64, -1), "weight2": w2.reshape(-1, 64),
                             "bias1": b1, "bias2": b2})
    counts = torch.tensor([5, 0, 9, 3])
    x, probs = torch.randn(17, 64, generator=g), torch.rand(17, generator=g)
    grad_out = torch.randn(17, 64, generator=g)
    ref = [t.clone().requires_grad_() for t in (x, probs, w1, w2, b1, b2)]
    rx, rp, rw1, rw2, rb1, rb2 = ref
    rows, first, clamped = [], 0, False
    for e, n in enumerate(counts.tolist()):
        gate, up = (rx[first:first + n] @ rw1[e] + rb1[e]).chunk(2, dim=-1)
        clamped |= bool((gate > 7).any() or (up.abs() > 7).any())
        act = quick_gelu(gate.clamp(max=7)) * (up.clamp(-7, 7) + 1)
        rows.append((act @ rw2[e] + rb2[e]) * rp[first:first + n, None])
        first += n
    want = torch.cat(rows)
    want.backward(grad_out)
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    got, bias = grouped(xi, counts, pi)
    got.backward(grad_out)
    assert bias is None
    res = {"biased_out": _max_diff(want.detach(), got.detach()), "biased_dx": _max_diff(rx.grad, xi.grad),
           "biased_dprobs": _max_diff(rp.grad, pi.grad), "biased_dbias1": _max_diff(rb1.grad, grouped.bias1.grad),
           "biased_dbias2": _max_diff(rb2.grad, grouped.bias2.grad),
           "biased_dweight1": _max_diff(rw1.grad.reshape(64, -1), grouped.weight1.grad)}
    res["biased_clamped"] = clamped
    res["biased_empty_expert_dbias"] = float(grouped.bias1.grad[1].abs().max())
    return res


def _into_main_grad(plain, x, counts, probs, grad_out, pgs) -> dict:
    """``gradient_accumulation_fusion``: the same experts add their weight gradients to DDP's fp32 ``main_grad``
    in the backward (twice here: two micro-batches accumulate) and leave Megatron's placeholder as ``.grad``."""
    from llamafactory_mca.models.native.experts import NativeGroupedMLP

    config = copy.copy(plain.config)
    config.gradient_accumulation_fusion = True
    fused = NativeGroupedMLP(4, config, pg_collection=pgs)
    fused.load_state_dict(plain.state_dict())
    start = {}
    for name, param in fused.named_parameters():
        param.main_grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(7))
        param.grad_added_to_main_grad = False
        start[name] = param.main_grad.clone()
    for _ in range(2):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y, _ = fused(xi, counts, pi)
        y.backward(grad_out)
    plain_x, plain_p = x.clone().requires_grad_(), probs.clone().requires_grad_()
    dx, dprobs = torch.autograd.grad(plain(plain_x, counts, plain_p)[0], (plain_x, plain_p), grad_out)
    res = {"fused_dx": _max_diff(xi.grad, dx), "fused_dprobs": _max_diff(pi.grad, dprobs),
           "fused_flags": all(p.grad_added_to_main_grad for p in fused.parameters()),
           "fused_grad_shapes": all(p.grad.shape == p.shape for p in fused.parameters())}
    for name, param in fused.named_parameters():
        res[f"fused_d{name}"] = _max_diff(param.main_grad, start[name] + 2 * getattr(plain, name).grad)
    return res


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("native_ckpt"))
    return ckpt, run_distributed(_single_process_suite, 1, ckpt)[0]


def test_native_equals_local_spec_on_padded_batches(reference):
    _, res = reference
    for name in ("dense", "moe_sequential", "moe_grouped"):
        assert res[f"parity_{name}_logits"] <= 1e-5, (name, res[f"parity_{name}_logits"])
        assert res[f"parity_{name}_grads"] <= 1e-5, (name, res[f"parity_{name}_grads"])
    for name in ("moe_sequential", "moe_grouped"):  # router gradients included: the probabilities' gather
        assert res[f"parity_{name}_dispatchers"] == ("MoEAlltoAllTokenDispatcher", "LocalTokenDispatcher")
    assert (res["dispatch_key_None"], res["dispatch_key_False"]) == ("LocalTokenDispatcher",
                                                                     "MoEAlltoAllTokenDispatcher")


def test_packed_thd_equals_per_sequence_forwards(reference):
    _, res = reference
    for name in ("dense", "moe"):
        assert res[f"thd_{name}_logits"] <= 1e-5, (name, res[f"thd_{name}_logits"])
        assert res[f"thd_{name}_grads"] <= 1e-5, (name, res[f"thd_{name}_grads"])


def test_cp2_equals_cp1_padded_and_thd(reference):
    from llamafactory_mca.data.context_parallel import local_token_index

    ckpt, res = reference
    per_rank = run_distributed(_cp2_run, 2, ckpt)
    for kind, ref_key in (("padded", "ref_dense"), ("thd", "ref_dense_thd")):
        ref = res[ref_key]
        full = torch.empty_like(ref["logits"])
        for rank, out in enumerate(per_rank):
            if kind == "padded":
                index = torch.tensor([rank, 3 - rank])
                full.view(BATCH, 4, SEQ // 4, VOCAB)[:, index] = out[kind]["logits"].view(BATCH, 2, SEQ // 4, VOCAB)
            else:
                full[:, local_token_index(_cu_seqlens().long(), rank, 2)] = out[kind]["logits"]
        torch.testing.assert_close(full, ref["logits"], **TOL)
        for name, grad in per_rank[0][kind]["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], atol=1e-4, rtol=1e-4, msg=f"{kind} {name}")


def test_tp2_sequence_parallel_with_native_norm(reference):
    ckpt, res = reference
    per_rank = run_distributed(_tp2_sp_run, 2, ckpt)
    ref = res["ref_dense"]
    marked = set()
    for out in per_rank:
        torch.testing.assert_close(out["logits"], ref["logits"], **TOL)
        for name, (grad, sp) in out["norm_grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], atol=1e-4, rtol=1e-4, msg=name)
            if sp:
                marked.add(name.split(".")[-2] if "layers" in name else name)
    assert {"input_layernorm", "pre_mlp_layernorm", "decoder.final_layernorm.weight"} <= marked, marked
    assert not any("q_layernorm" in m or "k_layernorm" in m for m in marked)


def test_ep2_alltoall_grouped_experts_load_sequential_checkpoint(reference):
    ckpt, res = reference
    per_rank = run_distributed(_ep2_run, 2, ckpt)
    ref = res["ref_moe"]
    for out in per_rank:
        torch.testing.assert_close(out["logits"], ref["logits"], **TOL)
        first = out["ep_rank"] * 2
        for which in (1, 2):
            # Both ranks ran the same batch, so each local expert saw twice the reference's tokens.
            expected = torch.stack([ref["grads"][f"decoder.layers.0.mlp.experts.local_experts.{first + e}."
                                                 f"linear_fc{which}.weight"].t() for e in range(2)])
            got = out[f"weight{which}_grad"]
            got = got.view(2, 64, -1) if which == 1 else got.view(2, -1, 64)
            torch.testing.assert_close(got, 2 * expected, atol=1e-4, rtol=1e-4)


def test_grouped_experts_equal_sequential_loop():
    res = run_distributed(_experts_suite, 1)[0]
    assert res["grouped_mm_used_kernel"] and not res["loop_fallback_used_kernel"]
    for name in ("grouped_mm", "loop_fallback"):
        for what in ("out", "dx", "dprobs", "dw1", "dw2"):
            assert res[f"{name}_{what}"] <= 1e-5, (name, what, res[f"{name}_{what}"])
        assert res[f"{name}_empty_expert_dw1"] == 0.0
    assert res["fused_flags"] and res["fused_grad_shapes"]
    for what in ("dx", "dprobs", "dweight1", "dweight2"):
        assert res[f"fused_{what}"] <= 1e-5, (what, res[f"fused_{what}"])
    for what in ("out", "dx", "dprobs", "dbias1", "dbias2", "dweight1"):
        assert res[f"biased_{what}"] <= 1e-4, (what, res[f"biased_{what}"])
    assert res["biased_clamped"] and res["biased_empty_expert_dbias"] == 0.0


# ----------------------------------------------------------------------------- in-process unit tests


def test_a_frozen_routers_backward_skips_its_weight_gradient():
    """megatron-core's router gating computes the weight's fp32 gradient even for LoRA's frozen router: ours gives the
    same logits and input gradient with one GEMM fewer, and both gradients where the router trains."""
    from llamafactory_mca.compat import apply_megatron_fixes
    from llamafactory_mca.models.native import routing

    apply_megatron_fixes()  # megatron-core's gating reads a TE name that is missing without TE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g).bfloat16()
    weight = torch.randn(8, 16, generator=g).bfloat16()
    upstream = torch.randn(2, 6, 8, generator=g)
    for trains in (False, True):
        found = {}
        for name, gating in (("megatron", routing.MEGATRON_GATING), ("ours", routing.router_gating_linear)):
            inp, w = x.clone().requires_grad_(), weight.clone().requires_grad_(trains)
            logits = gating(inp, w, None, torch.float32)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                logits.backward(upstream)
            gemms = sum(e.count for e in prof.key_averages() if e.key == "aten::mm")
            found[name] = (logits, inp.grad, w.grad, gemms)
        (logits, dx, dw, gemms), (our_logits, our_dx, our_dw, our_gemms) = found["megatron"], found["ours"]
        assert logits.dtype == torch.float32 and torch.equal(our_logits, logits) and torch.equal(our_dx, dx)
        assert (our_gemms, gemms) == ((2, 2) if trains else (1, 2))
        assert torch.equal(our_dw, dw) if trains else our_dw is None


def test_split_for_context_parallel_padded_and_thd():
    from llamafactory_mca.data.context_parallel import split_for_context_parallel

    tokens = torch.arange(16).view(2, 8)
    r0 = split_for_context_parallel({"tokens": tokens, "labels": None}, None, 0, 2)
    r1 = split_for_context_parallel({"tokens": tokens, "labels": None}, None, 1, 2)
    assert r0["tokens"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]] and r0["labels"] is None
    assert r1["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    packed = torch.arange(12).view(1, 12)
    cu = torch.tensor([0, 4, 12])
    assert split_for_context_parallel({"t": packed}, cu, 0, 2)["t"].tolist() == [[0, 3, 4, 5, 10, 11]]
    assert split_for_context_parallel({"t": packed}, cu, 1, 2)["t"].tolist() == [[1, 2, 6, 7, 8, 9]]
    with pytest.raises(ValueError, match="multiple of 2 x context_parallel_size"):
        split_for_context_parallel({"t": packed}, torch.tensor([0, 6, 12]), 0, 2)
    assert split_for_context_parallel({"t": packed}, cu, 0, 1)["t"] is packed


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_context_parallel_plan_matches_full_causal_attention(cp, window):
    """Simulate every CP rank in one process: gathered K/V + plan == plain per-sequence causal attention (with a
    sliding window: each query sees itself and the ``window`` keys before it, across the ranks' chunks too)."""
    from llamafactory_mca.data.context_parallel import local_token_index
    from llamafactory_mca.models.native.context_parallel import packed_plan
    from llamafactory_mca.models.native.kernels import make_plan, padded_attention, segment_attention

    lengths = [2 * cp * n for n in (1, 3, 2)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(cu[-1], 4, 8, generator=g), torch.randn(cu[-1], 2, 8, generator=g), torch.randn(
        cu[-1], 2, 8, generator=g)

    def reference(a: int, b: int) -> torch.Tensor:
        seen = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        if window is not None:
            seen &= ~torch.ones(b - a, b - a, dtype=torch.bool).tril(-window - 1)
        return F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                              attn_mask=seen, enable_gqa=True).transpose(0, 1)

    ref = torch.cat([reference(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    if cp == 1:  # plain packing: one square segment per sequence; and a padded row through SDPA's mask
        out = segment_attention(q, k, v, make_plan(lengths, lengths, torch.device("cpu")), 8 ** -0.5, window)
        torch.testing.assert_close(out, ref, **TOL)
        a, b = cu[1].item(), cu[2].item()
        out = padded_attention(q[a:b, None], k[a:b, None], v[a:b, None], 8 ** -0.5, True, window=window)
        torch.testing.assert_close(out[:, 0], reference(a, b).reshape(b - a, -1), **TOL)
        return
    index = [local_token_index(cu, r, cp) for r in range(cp)]
    gathered_k, gathered_v = torch.cat([k[i] for i in index]), torch.cat([v[i] for i in index])
    for r in range(cp):
        plan = packed_plan(cu, r, cp, len(index[r]), torch.device("cpu"))
        out = segment_attention(q[index[r]], gathered_k[plan.kv_index], gathered_v[plan.kv_index], plan,
                                scale=8 ** -0.5, window=window)
        torch.testing.assert_close(out, ref[index[r]], **TOL)


def test_prepare_config_turns_off_or_refuses(caplog):
    from megatron.core.transformer.enums import AttnBackend

    from llamafactory_mca.models import spec

    kwargs = {"apply_rope_fusion": True, "attention_backend": "fused", "bias_activation_fusion": True,
              "gradient_accumulation_fusion": True}
    with caplog.at_level(logging.INFO, logger="llamafactory_mca.models.spec"):
        spec.prepare_config(kwargs)
    assert kwargs["apply_rope_fusion"] is True and kwargs["attention_backend"] is AttnBackend.auto
    assert kwargs["bias_activation_fusion"] is False and kwargs["gradient_accumulation_fusion"] is False  # CPU run
    with caplog.at_level(logging.INFO, logger="llamafactory_mca.models.spec"):
        for unsupported in ("multi_latent_attention", "rotary_interleaved"):  # the fused RoPE does neither
            assert spec.prepare_config({"apply_rope_fusion": True, unsupported: True})["apply_rope_fusion"] is False
    assert "apply_rope_fusion=True turned off" in caplog.text
    assert spec.prepare_config({"attention_backend": "local"})["attention_backend"] is AttnBackend.local
    with pytest.raises(ValueError, match="fp4"):
        spec.prepare_config({"fp4": "nvfp4"})
    with pytest.raises(ValueError, match="context parallelism"):
        spec.prepare_config({"attention_backend": "local", "context_parallel_size": 2})


def test_spec_choice_and_checkpoint_keys():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    from llamafactory_mca.models import spec
    from llamafactory_mca.models.mapping import NORM_ALIASES
    from llamafactory_mca.models.native.attention import NativeDotProductAttention
    from llamafactory_mca.models.native.experts import NativeGroupedMLP

    class Cfg:  # just the fields the chooser reads
        attention_backend, num_moe_experts, moe_grouped_gemm, qk_layernorm = AttnBackend.auto, 8, True, True
        normalization, multi_latent_attention, context_parallel_size = "RMSNorm", False, 2
        softmax_type, window_size = "vanilla", None
        expert_model_parallel_size, expert_tensor_parallel_size, moe_expert_capacity_factor = 1, None, None
        moe_pad_expert_input_to_capacity = moe_shared_expert_overlap = False

    layer = spec.get_layer_spec(Cfg)
    attention = layer.submodules.self_attention
    assert attention.module is SelfAttention and attention.submodules.core_attention is NativeDotProductAttention
    assert layer.submodules.mlp.submodules.experts.module is NativeGroupedMLP
    # Megatron's MoELayer (TransformerLayer passes it its process groups); the layer installs the local routing
    assert layer.module.__name__ == "LocalDispatchLayer" and layer.submodules.mlp.module.__name__ == "MoELayer"
    assert "MoE experts: torch._grouped_mm, routing on the device" in spec.describe_kernels(Cfg)
    assert layer.submodules.sharded_state_dict_keys_map == NORM_ALIASES == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    assert "CP2 K/V all-gather" in spec.describe_kernels(Cfg) and "torch._grouped_mm" in spec.describe_kernels(Cfg)
    Cfg.attention_backend = AttnBackend.local
    assert spec.get_layer_spec(Cfg).submodules.self_attention.submodules.core_attention is DotProductAttention


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("per_position", [False, True])
def test_thd_rope_without_host_sync_equals_megatrons(cp, per_position):
    """Our device-side THD RoPE gives megatron-core's per-sequence result on every context-parallel rank, for
    frequencies per offset (max_seqlen rows) and per packed position (multimodal RoPE: one row per token)."""
    from types import SimpleNamespace

    from llamafactory_mca.models.native.rope import MEGATRON_THD_ROPE as original
    from llamafactory_mca.models.native.rope import apply_rotary_pos_emb_thd

    lengths = [8 * cp, 16 * cp, 4 * cp, 0, 12 * cp]  # multiples of 2·cp, one empty sequence
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    rows = int(cu[-1]) if per_position else max(lengths) + 3
    freqs = torch.randn(rows, 1, 1, 16, generator=g)
    for rank in range(cp):
        group = SimpleNamespace(size=lambda: cp, rank=lambda r=rank: r)
        t = torch.randn(int(cu[-1]) // cp, 4, 16, generator=g)
        expected = original(t, cu, freqs, cp_group=group)
        torch.testing.assert_close(apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=group), expected, rtol=0, atol=0)


@pytest.mark.parametrize("cp", [1, 2])
def test_fused_rope_slots_equal_the_unfused_rope(cp):
    """``apply_rope_fusion`` without TE: megatron-core's dispatcher reaches our fused slots, whose rotation (eager on
    CPU tensors; the Triton kernel's is compared with it below) equals its unfused one in value and gradient, packed
    (every CP rank, frequencies per offset and per packed position) and padded."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    from llamafactory_mca.models.native import install, rope

    install()
    assert rope.compiled_in_use()
    lengths = [8 * cp, 16 * cp, 4 * cp, 12 * cp]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    fused, unfused = (SimpleNamespace(apply_rope_fusion=on, rotary_interleaved=False, multi_latent_attention=False,
                                      mrope_section=None) for on in (True, False))

    def both(t, freqs, **kw):
        results = []
        for config in (fused, unfused):
            x = t.clone().requires_grad_()
            out = rope_utils.apply_rotary_pos_emb(x, freqs, config=config, **kw)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), x.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b)

    for rows in (max(lengths) + 3, int(cu[-1])):
        freqs = torch.randn(rows, 1, 1, 16, generator=g)
        for rank in range(cp):
            group = SimpleNamespace(size=lambda: cp, rank=lambda r=rank: r)
            both(torch.randn(int(cu[-1]) // cp, 4, 16, generator=g), freqs, cu_seqlens=cu, cp_group=group)
    both(torch.randn(12, 2, 4, 16, generator=g), torch.randn(12, 1, 1, 16, generator=g),
         cp_group=SimpleNamespace(size=lambda: 1, rank=lambda: 0))


_TRITON_AGAINST_EAGER = """
import torch
from megatron.core.models.common.embeddings import rope_utils
from llamafactory_mca.models.native import (combine_triton, cross_entropy, loss_triton, norm, norm_triton, rope,
                                            rope_triton, swiglu_triton)

def same(triton_fn, eager_fn, *inputs):
    results = []
    for fn in (triton_fn, eager_fn):
        xs = [x.clone().requires_grad_(x.is_floating_point() and x.dim() > 0) for x in inputs]
        out = fn(*xs)
        out.backward(torch.cos(out.detach()))
        results.append((out.detach(), *[x.grad for x in xs if x.requires_grad]))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

g = torch.Generator().manual_seed(0)
qkv = torch.randn(12, 2, 2, 4 * 16, generator=g)  # [s, b, groups, (2 q + k + v) heads x 16], as Megatron splits it
views = {"whole": lambda x: x, "q": lambda x: x[..., :32].unflatten(-1, (2, 16)).flatten(2, 3),
         "k": lambda x: x[..., 32:48]}  # q and k: strided views, as the kernels get them
for x, view in ((torch.randn(64, 4, 16, generator=g), "whole"), (torch.randn(9, 20, generator=g), "whole"),
                (qkv, "q"), (qkv, "k")):
    part = views[view]
    w = 1 + torch.randn(part(x).size(-1), generator=g) / 4
    same(lambda x, w: norm_triton.rms_norm(part(x), w, 1e-6), lambda x, w: norm._head_rms_norm(part(x), w, 1e-6),
         x, w)
    same(lambda x, w: norm_triton.rms_norm(part(x), w, 1e-6, offset=1.0),
         lambda x, w: norm._zero_centred_rms_norm(part(x), w, 1e-6), x, w / 4)
    frozen = torch.zeros(part(x).size(-1))  # a frozen weight (LoRA's base): no weight gradient asked
    same(lambda x: norm_triton.rms_norm(part(x), frozen, 1e-6, offset=1.0),
         lambda x: torch.nn.functional.rms_norm(part(x), (frozen.numel(),), eps=1e-6), x)
for view in ("q", "k"):  # MiniMax-M2's norms across all heads of a token, as ProjectionRMSNorm runs them
    part = views[view]
    w = 1 + torch.randn(part(qkv)[0, 0].numel(), generator=g) / 4
    same(lambda x, w: norm_triton.rms_norm(part(x).flatten(-2), w, 1e-6).view_as(part(x)),
         lambda x, w: norm._across_heads_rms_norm(part(x), w, w.numel(), 1e-6), qkv, w)

cu = torch.tensor([0, 8, 20, 24, 40])
for rotary, dim in ((16, 16), (8, 16), (12, 20)):  # whole, half and partial rotary widths
    for cp_size, cp_rank in ((1, 0), (2, 1)):
        positions = rope.thd_positions(cu, 40 // cp_size, cp_size, cp_rank, False)
        t, freqs = torch.randn(len(positions), 3, dim, generator=g), torch.randn(48, 1, 1, rotary, generator=g)
        same(lambda t: rope_triton.rotate(t, freqs, positions), lambda t: rope._rotate(t, freqs, positions, False), t)
    padded = torch.randn(10, 2, 3, dim, generator=g)
    for freqs in (torch.randn(10, 1, 1, rotary, generator=g), torch.randn(10, 2, 1, rotary, generator=g)):
        same(lambda t: rope_triton.rotate(t, freqs, None), lambda t: rope._rotate(t, freqs, None, False), padded)
    freqs = torch.randn(12, 1, 1, rotary, generator=g)  # and a strided view of the fused QKV
    same(lambda x: rope_triton.rotate(x[..., :dim], freqs, None), lambda x: rope._rotate(x[..., :dim], freqs, None,
                                                                                        False), qkv)

def eager_swiglu(x, w=None):  # Megatron's fused SwiGLU, uncompiled
    a, b = x.chunk(2, -1)
    y = torch.nn.functional.silu(a) * b
    return y if w is None else y * w

def eager_geglu(x):  # Megatron's fused GeGLU's forward, uncompiled (autograd gives its backward)
    a, b = x.chunk(2, -1)
    return (a * 0.5 * (1.0 + torch.tanh(0.79788456 * a * (1 + 0.044715 * a * a)))) * b

for rows, width in ((7, 768), (5, 24), (3, 11)):  # the experts' width (no masked lanes), a narrow one, an odd one
    x = torch.randn(rows, 2 * width, generator=g)
    same(swiglu_triton.swiglu, eager_swiglu, x)
    same(swiglu_triton.swiglu, eager_swiglu, x, torch.rand(rows, 1, generator=g))
    same(swiglu_triton.geglu, eager_geglu, 3 * x)
    gate, other = x.chunk(2, -1)  # two tensors (Gemma 4's per-layer inputs)
    same(swiglu_triton.gelu_times, lambda a, b: eager_geglu(torch.cat([a, b], -1)), 3 * gate.contiguous(), other)

logits = torch.randn(6, 5000, generator=g) * 4  # more than one block of the vocabulary
logits[1, 4100:] = float("-inf")  # a tensor-parallel slice's vocabulary padding
for a, b in zip(loss_triton.row_stats(logits), cross_entropy._row_stats(logits), strict=True):
    torch.testing.assert_close(a, b)
assert [float(v) for v in loss_triton.row_stats(torch.full((1, 5000), float("-inf")))] == [float("-inf"), 0.0]
row_max, sum_exp = cross_entropy._row_stats(logits)
lse, grad, target = row_max + sum_exp.log(), torch.rand(6, generator=g), torch.tensor([3, -1, 4999, 0, 4096, 17])
torch.testing.assert_close(loss_triton.grad(logits, lse, grad, target), cross_entropy._grad(logits, lse, grad, target))
for a, b in zip(loss_triton.row_stats(logits, 3.0), cross_entropy._row_stats(logits, 3.0), strict=True):  # capped
    torch.testing.assert_close(a, b)
row_max, sum_exp = cross_entropy._row_stats(logits, 3.0)
lse = row_max + sum_exp.log()
torch.testing.assert_close(loss_triton.grad(logits, lse, grad, target, 3.0),
                           cross_entropy._grad(logits, lse, grad, target, 3.0))

rows, topk = torch.randn(4 * 3, 40, generator=g), 3  # 4 tokens' 3 rows each, in expert order
rows_of_token = torch.randperm(12, generator=g)
torch.testing.assert_close(combine_triton.gather_sum(rows, rows_of_token, topk),
                           rows[rows_of_token].view(4, topk, 40).sum(1))
print("triton kernels equal eager")
"""


def test_triton_kernels_equal_the_eager_ones():
    """GPUs run Triton kernels where CPU runs use eager torch (``*_triton.py``); here they run in Triton's interpreter
    on CPU against the eager functions, in value and gradient: the norms over per-head and hidden-width rows, the (1 +
    weight) scale, a frozen weight, q and k read where the fused QKV split left them (strided), per head and across all
    heads of a token; packed RoPE at each CP rank's positions and padded RoPE, rotary width whole, half and partial;
    SwiGLU plain and weighted (the weight's gradient too) and GeGLU (GELU's tanh approximation; over halves and over
    two tensors) at widths with and without masked lanes; the loss's row statistics over vocabulary blocks with -inf
    padding (a row of it alone: max -inf, sum 0) and its gradient at targets inside and outside the slice, both also
    through a soft cap; the MoE combine. tests/gpu compares them in bf16."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernels are defined: a process of its own
    result = subprocess.run([sys.executable, "-c", _TRITON_AGAINST_EAGER], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and "triton kernels equal eager" in result.stdout, result.stderr[-3000:]


def test_qk_norm_fusion_applies_to_plain_per_head_norms():
    """What the startup summary and NativeNorm ask: zero-centred q/k norms (Qwen3-Next, Qwen3.5) are not the per-head
    fused norm (they are the (1 + w) one); CPU tensors run the eager function."""
    from types import SimpleNamespace

    from llamafactory_mca.models.native import norm

    x = torch.randn(64, 4, 16)
    assert norm.HeadRMSNorm(16, 1e-6, "cpu", torch.float32, fused=True)(x).shape == x.shape
    plain = SimpleNamespace(qk_norm_fusion=True, normalization="RMSNorm", layernorm_zero_centered_gamma=False)
    assert norm.compiles_head_norms(plain)
    assert not norm.compiles_head_norms(SimpleNamespace(**{**vars(plain), "layernorm_zero_centered_gamma": True}))
    assert not norm.compiles_head_norms(SimpleNamespace(**{**vars(plain), "qk_norm_fusion": False}))


def test_step_one_note_counts_compile_time():
    """The line after step 1 says how much of it torch.compile took, and LLAMAFACTORY_MCA_DEBUG=1 lists the graphs:
    a function compiled here shows up by name, its seconds counted in the total."""
    from llamafactory_mca.trainer.metrics import compile_records, compile_seconds

    def doubled_sine(x):
        return (2 * x).sin()

    before = compile_seconds()
    torch.compile(doubled_sine, backend="eager")(torch.randn(4))
    assert compile_seconds() > before
    assert any(line.endswith("doubled_sine (test_native_spec.py)") for line in compile_records()), compile_records()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulation_adds_the_weight_gradient(dtype):
    """apex's wgrad_gemm_accum_fp32 contract (main_grad += dy^T x, in fp32), which Megatron's linears call under
    gradient_accumulation_fusion; on CPU the fallback path (tests/gpu runs the CUDA addmm one)."""
    from llamafactory_mca.models.native import wgrad

    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(64, 24, generator=gen).to(dtype), torch.randn(64, 40, generator=gen).to(dtype)
    main_grad = torch.randn(40, 24, generator=gen)
    expected = main_grad.double() + dy.double().t() @ x.double()
    wgrad.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert main_grad.dtype is torch.float32
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-5, atol=1e-5)


def _cross_entropy_run(tp: int) -> dict:
    """Ours against Megatron's vocab_parallel_cross_entropy on this rank's vocabulary slice: losses and the logits'
    gradients, fp32 and bf16, with -100 labels and more rows than one eager chunk."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatrons

    from llamafactory_mca import parallel
    from llamafactory_mca.models.native import cross_entropy

    parallel.initialize(_layout(world=tp, tp=tp), seed=3)
    cross_entropy._EAGER_ROWS = 7  # several chunks, the last one short
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(9, 2, VOCAB, generator=g) * 4
    labels = torch.randint(0, VOCAB, (9, 2), generator=g)
    labels[0, 0] = labels[3, 1] = -100
    grad = torch.randn(9, 2, generator=g)
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        part = full.chunk(tp, dim=-1)[rank].to(dtype)
        mine, ref = part.clone().requires_grad_(), part.clone().requires_grad_()
        loss = cross_entropy.vocab_parallel_cross_entropy(mine, labels, group)
        expected = megatrons(ref, labels)
        (loss * grad).sum().backward()
        (expected * grad).sum().backward()
        res[str(dtype)] = (_rel_diff(loss, expected), _rel_diff(mine.grad.float(), ref.grad.float()), loss.dtype,
                           mine.grad.dtype)
    # the vocabulary padding's logits are -inf (auto._mask_vocab_padding); under a tiny vocabulary a whole TP slice
    # is padding: the loss must still be finite and Megatron's
    padded = full.clone()
    padded[..., VOCAB // 2:] = float("-inf")
    part = padded.chunk(tp, dim=-1)[rank]
    mine, ref = part.clone().requires_grad_(), part.clone().requires_grad_()
    small = torch.where(labels >= 0, labels % (VOCAB // 2), labels)
    loss = cross_entropy.vocab_parallel_cross_entropy(mine, small, group)
    expected = megatrons(ref, small)
    (loss * grad).sum().backward()
    (expected * grad).sum().backward()
    res["padded"] = (bool(torch.isfinite(loss).all()), _rel_diff(loss, expected), _rel_diff(mine.grad, ref.grad))
    # soft-capped (Gemma's): ours caps the raw logits inside its passes, Megatron's takes them capped, padding -inf
    mine, ref = part.clone().requires_grad_(), part.clone().requires_grad_()
    loss = cross_entropy.vocab_parallel_cross_entropy(mine, small, group, cap=3.0)
    capped = torch.where(ref == float("-inf"), ref, torch.tanh(ref / 3.0) * 3.0)
    expected = megatrons(capped, small)
    (loss * grad).sum().backward()
    (expected * grad).sum().backward()
    res["capped"] = (_rel_diff(loss, expected), _rel_diff(mine.grad, ref.grad))
    return res


@pytest.mark.parametrize("tp", [1, 2])
def test_native_cross_entropy_equals_megatrons(tp):
    for rank_res in run_distributed(_cross_entropy_run, tp, tp):
        loss_err, grad_err, loss_dtype, grad_dtype = rank_res["torch.float32"]
        assert loss_err < 1e-6 and grad_err < 1e-6 and loss_dtype is torch.float32, rank_res
        loss_err, grad_err, loss_dtype, grad_dtype = rank_res["torch.bfloat16"]
        # the loss in fp32 from bf16 logits (as Megatron's); gradients rounded once, to bf16
        assert loss_err < 1e-6 and grad_err < 1e-2 and grad_dtype is torch.bfloat16, rank_res
        finite, loss_err, grad_err = rank_res["padded"]
        assert finite and loss_err < 1e-6 and grad_err < 1e-6, rank_res
        assert max(rank_res["capped"]) < 1e-6, rank_res


def _chunked_loss_run(tp: int, cap: float | None) -> dict:
    """The output layer and loss fused over row chunks against the logits at once, on one model: per-token losses
    and every parameter's gradient, under TP with sequence parallelism, the vocabulary padding masked (part of the
    last slice) and chunks that do not divide the rows. With soft-capped logits, both against Megatron's loss over
    the logits capped by the output layer's hook. And both computing only the rows whose target counts
    (``loss_rows``): the same losses where the loss mask counts them, and the same gradients."""
    from megatron.core import parallel_state as ps

    from llamafactory_mca import parallel
    from llamafactory_mca.models import spec
    from llamafactory_mca.models.auto import _mask_vocab_padding
    from llamafactory_mca.models.native import cross_entropy

    parallel.initialize(_layout(world=tp, tp=tp), seed=3)
    cross_entropy.CHUNK_ROWS = 5
    config = _config(tp=tp, sp=tp > 1)
    config.final_logit_softcapping = cap
    model = cross_entropy.LanguageModel(config, spec.get_block_spec(config), vocab_size=VOCAB, max_sequence_length=64,
                                        position_embedding_type="rope", rotary_base=10000)
    _mask_vocab_padding(model, VOCAB - 5)
    tokens = _inputs()[0]
    labels = torch.roll(tokens, -1, dims=1) % (VOCAB - 5)
    labels[0, :3] = -100
    labels[1, -4:] = -100
    counts = labels != -100  # the loss mask: training multiplies the per-token losses by it
    rows = counts.t().reshape(-1).nonzero().squeeze(1)  # sequence-major, as MicroBatch.loss_rows
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(7)) * counts
    handed = []
    model.output_layer.register_forward_hook(lambda module, inputs, output: handed.append(type(output[0]).__name__))
    res = {}
    for chunked in (False, True, "rows", "rows_chunked") + (("megatron",) if cap else ()):
        model.zero_grad()
        config.chunked_cross_entropy = chunked in (True, "rows_chunked")
        config.native_cross_entropy = chunked != "megatron"
        kept = {"loss_rows": rows} if chunked in ("rows", "rows_chunked") else {}
        loss = model(tokens, _positions(tokens), None, labels=labels, **kept)
        (loss * weights).sum().backward()
        grads = _grads(model)
        if tp > 1:  # sequence-parallel norms' gradients are partial per rank until the optimizer reduces them
            grads = {n: g for n, g in grads.items() if "layernorm" not in n and "norm" not in n.split(".")[-2]}
        res[chunked] = ((loss * counts).detach(), grads)
    out = {"handed": handed, "rank": ps.get_tensor_model_parallel_rank()}
    pairs = {"chunked": (res[True], res[False]), "megatron": (res[True], res.get("megatron")),
             "rows": (res["rows"], res[False]), "rows_chunked": (res["rows_chunked"], res[True])}
    for name, (a, b) in pairs.items():
        if b is not None:
            out[name] = {"loss": _rel_diff(a[0], b[0]), "same_params": sorted(a[1]) == sorted(b[1]),
                         "grads": max(_rel_diff(a[1][n], b[1][n]) for n in b[1]),
                         "output_grad": _rel_diff(a[1]["output_layer.weight"], b[1]["output_layer.weight"])}
    return out


@pytest.mark.parametrize("tp,cap", [(1, None), (2, None), (2, 0.1)])
def test_chunked_output_layer_and_loss_equal_the_logits_at_once(tp, cap):
    for rank_res in run_distributed(_chunked_loss_run, tp, tp, cap):
        assert rank_res["handed"][:2] == ["Tensor", "DeferredLogits"], rank_res
        for name in ("chunked", "rows", "rows_chunked") + (("megatron",) if cap else ()):
            got = rank_res[name]
            assert got["same_params"] and got["loss"] < 1e-6 and got["grads"] < 1e-5 and got["output_grad"] < 1e-5, \
                rank_res


def _embedding_rows_run(tp: int) -> dict:
    """The model's word embeddings with a ``main_grad`` (as DDP gives one) against the same lookup without: the
    rows' gradients added into it must equal torch's dense gradient, under TP with sequence parallelism (other
    ranks' tokens masked, the output reduce-scattered), a repeated token added up, and the pad row left out."""
    from llamafactory_mca import parallel
    from llamafactory_mca.models import spec
    from llamafactory_mca.models.native import cross_entropy, embedding

    parallel.initialize(_layout(world=tp, tp=tp), seed=3)
    config = _config(tp=tp, sp=tp > 1)
    model = cross_entropy.LanguageModel(config, spec.get_block_spec(config), vocab_size=VOCAB, max_sequence_length=64,
                                        position_embedding_type="rope", rotary_base=10000)
    table = model.embedding.word_embeddings
    tokens = _inputs()[0]
    tokens[1, :4] = tokens[0, 0]  # one token five times
    grad = torch.randn(table(tokens).shape, generator=torch.Generator().manual_seed(9))
    start = torch.randn(table.weight.shape, generator=torch.Generator().manual_seed(8))
    table.weight.main_grad = start.clone()
    table.weight.grad_added_to_main_grad = False
    (table(tokens) * grad).sum().backward()
    rows = (table.weight.main_grad - start, table.weight.grad_added_to_main_grad, tuple(table.weight.grad.shape))
    del table.weight.main_grad, table.weight.grad_added_to_main_grad
    table.weight.grad = None
    (table(tokens) * grad).sum().backward()
    res = {"class": type(table).__name__, "rows": _rel_diff(rows[0], table.weight.grad), "flag": rows[1],
           "placeholder": rows[2] == tuple(table.weight.shape)}
    # the pad row: not trained, as torch's embedding with padding_idx (the per-layer inputs' table)
    weight = torch.nn.Parameter(torch.randn(VOCAB, 8))
    weight.main_grad, weight.grad_added_to_main_grad = torch.zeros(VOCAB, 8), False
    out_grad = torch.randn(*tokens.shape, 8)
    (embedding.lookup(tokens, weight, padding_idx=int(tokens[0, 0])) * out_grad).sum().backward()
    dense = weight.detach().clone().requires_grad_()
    (F.embedding(tokens, dense, padding_idx=int(tokens[0, 0])) * out_grad).sum().backward()
    res["padded"] = _rel_diff(weight.main_grad, dense.grad)
    return res


@pytest.mark.parametrize("tp", [1, 2])
def test_embedding_adds_its_rows_into_main_grad(tp):
    for rank_res in run_distributed(_embedding_rows_run, tp, tp):
        assert rank_res["class"] == "RowGradEmbedding" and rank_res["flag"] and rank_res["placeholder"], rank_res
        assert rank_res["rows"] < 1e-6 and rank_res["padded"] < 1e-6, rank_res


def _tied_table_run(cuda: bool = False) -> dict:
    """Two micro-batches through a model whose output layer multiplies by its word embeddings, under Megatron's DDP
    and without: the table's gradients, and the table-sized ops (adds, fills) the DDP run's backward made. On CUDA in
    bf16 with gradient accumulation fused (the output layer's weight gradient into ``main_grad`` by its GEMM)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from llamafactory_mca import parallel
    from llamafactory_mca.models import spec
    from llamafactory_mca.models.native import cross_entropy

    parallel.initialize(_layout(), seed=3)
    reference = _config()
    if cuda:
        reference = dataclasses.replace(reference, bf16=True, params_dtype=torch.bfloat16,
                                        pipeline_dtype=torch.bfloat16)
    # fused accumulation needs DDP's main_grad: the reference without DDP computes its gradient as autograd does
    fused = dataclasses.replace(reference, gradient_accumulation_fusion=True) if cuda else reference
    device = "cuda" if cuda else "cpu"
    tokens = _inputs()[0].to(device)
    positions = _positions(tokens).to(device)
    vocab = VOCAB + 8  # a table shape no other weight has
    grads, table_ops, zero_out = [], [], None
    for ddp in (False, True):
        torch.manual_seed(0)
        config = fused if ddp else reference
        model = cross_entropy.LanguageModel(config, spec.get_block_spec(config), vocab_size=vocab,
                                            max_sequence_length=64, position_embedding_type="rope",
                                            rotary_base=10000, share_embeddings_and_output_weights=True).to(device)
        table = model.embedding.word_embeddings.weight
        if ddp:
            model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(2):
                model(tokens, positions, None, labels=tokens).sum().backward()
        grads.append((table.main_grad if ddp else table.grad).float())
        if ddp:
            zero_out = getattr(table, "zero_out_wgrad", False)
            table_ops = [e.name for e in prof.events() if e.name in ("aten::add", "aten::add_", "aten::fill_")
                         and e.input_shapes and list(e.input_shapes[0]) == list(table.shape)]
    return {"rel": _rel_diff(grads[1], grads[0]), "table_ops": table_ops, "zero_out": zero_out}


def test_tied_table_takes_one_gradient_per_micro_batch():
    """A table the output layer also multiplies by: under DDP its ``main_grad`` is autograd's gradient of both uses.
    The lookup adds its rows into ``main_grad`` and hands autograd nothing, so Megatron's zeroed placeholder
    (``zero_out_wgrad``, for a dense embedding gradient added beside it) is off, and the only table-sized op per
    micro-batch is DDP's add of the output layer's unfused gradient (none on GPUs: ``tests/gpu``)."""
    res = run_distributed(_tied_table_run, 1)[0]
    assert res["rel"] < 1e-6 and res["table_ops"] == ["aten::add_"] * 2 and not res["zero_out"], res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rmsnorm_is_qwen3_nexts(dtype):
    """``layernorm_zero_centered_gamma``: scale 1 + weight, as transformers' Qwen3-Next / Qwen3.5 norms: equal
    outputs and weight gradients from the same stored weight, the weight starting at zero."""
    from megatron.core.transformer import TransformerConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    from llamafactory_mca.models.native.norm import NativeNorm

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                               layernorm_zero_centered_gamma=True, use_cpu_initialization=True, params_dtype=dtype)
    ours, theirs = NativeNorm(config, 64, eps=1e-6), Qwen3NextRMSNorm(64, eps=1e-6).to(dtype)
    assert torch.equal(ours.weight, torch.zeros(64, dtype=dtype)) and list(ours.state_dict()) == ["weight"]
    weight = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(dtype) * 0.1
    for norm in (ours, theirs):
        norm.weight.data.copy_(weight)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    outs = [norm(x) for norm in (ours, theirs)]
    assert outs[0].dtype == dtype and torch.equal(outs[0], outs[1])
    for out in outs:
        out.float().square().sum().backward()
    assert torch.allclose(ours.weight.grad.float(), theirs.weight.grad.float(), rtol=1e-5, atol=1e-5)


def test_startup_summary_names_the_sliding_windows():
    """HF's sliding_window on the layers its layer_types names: Megatron's fields, and the summary's kernel line."""
    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.models.spec import describe_kernels
    from llamafactory_mca.tools.tiny import tiny_hf_config

    lines = {}
    for name in ("mistral", "qwen2", "qwen3"):
        hf = tiny_hf_config(name)
        config = get_family(hf.model_type).config_from_hf(hf).to_transformer_config({})
        lines[name] = describe_kernels(config)
        if name == "qwen2":
            assert config.window_size == (5, 0) and config.window_attn_skip_freq == [0, 0, 1, 1]
    hf = tiny_hf_config("gemma3_text")
    lines["gemma3_text"] = describe_kernels(get_family(hf.model_type).config_from_hf(hf).to_transformer_config({}))
    assert "sliding window 6 tokens on 3 of 4 layers" in lines["gemma3_text"]
    assert "RoPE base 10000 there" in lines["gemma3_text"] and "layer spec: native" in lines["gemma3_text"]
    assert "sliding window 8 tokens on every layer" in lines["mistral"]
    assert "sliding window 6 tokens on 2 of 4 layers" in lines["qwen2"]
    assert "sliding window" not in lines["qwen3"]
    # a model converted before the kernels had windows (its saved config has HF's window, not Megatron's fields)
    hf = tiny_hf_config("qwen2")
    saved = get_family(hf.model_type).config_from_hf(hf)
    saved.transformer = {k: v for k, v in saved.transformer.items() if not k.startswith("window")}
    config = saved.to_transformer_config({})
    assert config.window_size == (5, 0) and config.window_attn_skip_freq == [0, 0, 1, 1]


def test_flops_count_the_pairs_a_sliding_window_sees():
    """MFU's attention term: a window of W tokens sees s·W - W²/2 causal pairs of a longer sequence, on its layers."""
    from llamafactory_mca.models.cost import core_attention_flops

    t = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16)
    full = core_attention_flops(t, [32, 4])
    every = core_attention_flops(dict(t, window_size=(7, 0)), [32, 4])  # W = 8
    half = core_attention_flops(dict(t, window_size=(7, 0), window_attn_skip_freq=[0, 1, 0, 1]), [32, 4])
    per_square = full / (32 * 32 + 4 * 4)
    assert every == pytest.approx(per_square * (2 * 32 * 8 - 8 * 8 + 4 * 4))
    assert half == pytest.approx((full + every) / 2)
    assert core_attention_flops(dict(t, window_size=(31, 0)), [32, 4]) == pytest.approx(full)  # fits: no change


def test_gemma3_config_carries_its_scales_and_refuses_what_it_cannot_honour(monkeypatch):
    """Gemma 3's fields reach the TransformerConfig (and the layers that read them); the tanh GeGLU is Megatron's
    fused F.gelu only where the fusion runs (its kernel is the tanh approximation), ours elsewhere; a config this
    backend would train differently is refused by name."""
    import torch.nn.functional as F

    from llamafactory_mca.models.config import gelu_tanh
    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.tools.tiny import tiny_hf_config

    hf = tiny_hf_config("gemma3_text")
    mca = get_family(hf.model_type).config_from_hf(hf)
    config = mca.to_transformer_config({})
    assert config.softmax_scale == 16 ** -0.5 and config.embedding_multiplier == 64 ** 0.5
    assert config.post_layer_norms and config.layernorm_zero_centered_gamma and config.window_rotary_base == 10000.0
    assert config.activation_func is gelu_tanh and not config.bias_activation_fusion  # CPU: unfused
    assert mca.rotary_base == 1e6 and mca.rope_parameters["rope_type"] == "linear"
    from llamafactory_mca.models import spec

    monkeypatch.setattr(spec, "_cpu_only", lambda: False)  # as on a GPU, where the fusion stays on
    fused = mca.to_transformer_config({}, bias_activation_fusion=True)
    assert fused.activation_func is F.gelu and fused.bias_activation_fusion
    # qk_norm_fusion (on with CUDA graphs) compiles every (1 + w) norm on GPUs, and the summary says so
    from llamafactory_mca.models.native.norm import NativeNorm

    plain = mca.to_transformer_config({}, use_cpu_initialization=True)
    assert not NativeNorm(plain, 64).fused and "(1 + w) norms" not in spec.describe_kernels(plain)
    fused = mca.to_transformer_config({}, use_cpu_initialization=True, qk_norm_fusion=True)
    assert NativeNorm(fused, 64).fused and "Triton: (1 + w) norms" in spec.describe_kernels(fused)
    for overrides, message in [({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
                               ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
                               ({"hidden_activation": "gelu"}, "hidden_act='gelu'"),
                               ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                           "rope_theta": 10000.0},
                                                     "full_attention": {"rope_type": "default",
                                                                        "rope_theta": 1e6}}},
                                "rope_type='linear' on the sliding-window layers")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            get_family("gemma3_text").config_from_hf(tiny_hf_config("gemma3_text", **overrides))


def _hf_sink_attention(q, k, v, sink, scale, window):
    """transformers' gpt-oss eager attention (the reference for attention sinks), one sequence: ``[s, h, d]``."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    s = q.size(0)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if window is not None:
        allowed &= ~torch.ones(s, s, dtype=torch.bool).tril(-window - 1)
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=q.size(1) // k.size(1), sinks=sink, training=False)
    out, _ = eager_attention_forward(module, *(t.transpose(0, 1)[None] for t in (q, k, v)), mask, scale)
    return out[0]


@pytest.mark.parametrize("window", [None, 3])
def test_attention_sinks_match_transformers_eager_attention(window):
    """softmax_type learnable (gpt-oss's sinks) on the CPU path: packed, padded and CP-gathered segments give
    transformers' eager attention with ``sinks``, values and gradients (queries, keys, values, the sinks), with
    grouped-query heads and a sliding window."""
    from llamafactory_mca.data.context_parallel import local_token_index
    from llamafactory_mca.models.native import context_parallel as cp_utils
    from llamafactory_mca.models.native.kernels import make_plan, padded_attention, segment_attention

    g = torch.Generator().manual_seed(5)
    lengths = [7, 12, 5]
    q, k, v = (torch.randn(sum(lengths), h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    sink = torch.randn(4, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v, sink)]
    scale = 8 ** -0.5
    out = segment_attention(q, k, v, make_plan(lengths, lengths, torch.device("cpu")), scale, window, sink)
    bounds = [0, *itertools.accumulate(lengths)]
    want = torch.cat([_hf_sink_attention(q[a:b], k[a:b], v[a:b], sink, scale, window)
                      for a, b in itertools.pairwise(bounds)])
    assert _max_diff(out, want) < 1e-12
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad((out * weights).sum(), leaves)
    theirs = torch.autograd.grad((want * weights).sum(), leaves)
    for name, a, b in zip("qkv", ours, theirs):
        assert _max_diff(a, b) < 1e-12, name
    assert _max_diff(ours[3], theirs[3]) < 1e-12 and ours[3].abs().max() > 0
    # a padded batch of one row, and the second sequence as CP2's two query segments over the gathered keys
    a, b = bounds[1], bounds[2]
    padded = padded_attention(q[a:b, None], k[a:b, None], v[a:b, None], scale, True, window=window, sink=sink)
    assert _max_diff(padded.view(b - a, 4, 8), want[a:b]) < 1e-12
    cu = torch.tensor([0, b - a])
    index = [local_token_index(cu, rank, 2) for rank in range(2)]
    keys, values = torch.cat([k[a:b][i] for i in index]), torch.cat([v[a:b][i] for i in index])
    for rank in range(2):
        plan = cp_utils.packed_plan(cu, rank, 2, len(index[rank]), torch.device("cpu"))
        got = segment_attention(q[a:b][index[rank]], keys[plan.kv_index], values[plan.kv_index], plan, scale, window,
                                sink)
        assert _max_diff(got, want[a:b][index[rank]]) < 1e-12


def _learnable_softmax_suite() -> dict:
    from llamafactory_mca import parallel

    parallel.initialize(_layout())
    models = {}
    for backend in ("local", "auto"):
        config = _config(backend=backend)
        config.softmax_type = "learnable"
        torch.manual_seed(0)
        models[backend] = _model(config)
    native, local = models["auto"], models["local"]
    native.load_state_dict(local.state_dict())
    tokens, _, weights, _ = _inputs()
    outs = {}
    for name, model in models.items():
        logits = _forward(model, tokens)
        (logits * weights).sum().backward()
        outs[name] = logits.detach(), _grads(model)
    offset = "decoder.layers.1.self_attention.core_attention.softmax_offset"
    saved = native.sharded_state_dict()["decoder.layers.0.self_attention.core_attention.softmax_offset"]
    return {"names": set(dict(native.named_parameters())), "logits": _max_diff(outs["auto"][0], outs["local"][0]),
            "offset_grad": _rel_diff(outs["auto"][1][offset], outs["local"][1][offset]),
            "offset_grad_max": float(outs["auto"][1][offset].abs().max()), "key": saved.key,
            "global_shape": tuple(saved.global_shape),
            "tp_split": bool(native.decoder.layers[0].self_attention.core_attention.softmax_offset
                             .tensor_model_parallel)}


def test_wide_heads_attention_is_sdpa_with_grouped_keys():
    """Heads wider than flash and cuDNN take (Gemma 4's 512) run as two batched GEMMs around an fp32 softmax, each
    key/value head serving its group of query heads in turn: SDPA's result with ``enable_gqa``, causal (aligned
    bottom-right) and windowed, values of their own width too; gradients included; and in bf16 within its rounding."""
    from llamafactory_mca.models.native.kernels import _causal_band, _wide_heads

    g = torch.Generator().manual_seed(0)
    for lq, lk, window, dv in ((7, 7, None, 24), (5, 9, None, 24), (9, 9, 3, 16)):
        q, k, v = (torch.randn(shape, generator=g, requires_grad=True) for shape in
                   ((6, lq, 24), (2, lk, 24), (2, lk, dv)))
        allowed = _causal_band(lq, lk, window, torch.device("cpu"))
        ours = _wide_heads(q, k, v, allowed, 0.3)
        grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, torch.autograd.grad(theirs.square().sum(), (q, k, v))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # in bf16 at Gemma 4's width (heads of 512 normed to RMS 1, q·k unscaled: scores in the hundreds, which the fp32
    # score GEMMs keep), against fp32 on the same bf16 values: within bf16's rounding, forward and backward
    q, k, v = (torch.randn(384, heads, 512, generator=g) for heads in (8, 1, 1))
    q, k = (t / t.square().mean(-1, keepdim=True).sqrt() for t in (q, k))
    allowed = _causal_band(384, 384, None, torch.device("cpu"))
    results = []
    for dtype, fn in ((torch.bfloat16, lambda *x: _wide_heads(*x, allowed, 1.0)),
                      (torch.float32, lambda *x: F.scaled_dot_product_attention(*x, is_causal=True, scale=1.0,
                                                                                 enable_gqa=True))):
        xs = [t.transpose(0, 1).bfloat16().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        out.backward(torch.cos(out.detach()))
        results.append([out.float(), *[x.grad.float() for x in xs]])
    for a, b in zip(*results, strict=True):
        assert (a - b).abs().max() <= 1e-2 * b.abs().max(), ((a - b).abs().max(), b.abs().max())


def test_learnable_softmax_equals_megatron_local_attention():
    """The native attention with Megatron's ``softmax_type: learnable`` gives Megatron's local attention (its
    ``softmax_offset`` per head): same parameter names, same logits and offset gradients; its checkpoint key is
    split over TP by head, and the parameter is marked so the gradient norm counts every rank's heads."""
    res = run_distributed(_learnable_softmax_suite, 1)[0]
    assert "decoder.layers.0.self_attention.core_attention.softmax_offset" in res["names"]
    assert res["logits"] < 1e-5 and res["offset_grad"] < 1e-5 and res["offset_grad_max"] > 0
    assert res["key"] == "decoder.layers.self_attention.core_attention.softmax_offset"
    assert res["global_shape"] == (2, 4) and res["tp_split"]


def test_gpt_oss_config_summary_and_refusals(tmp_path):
    """gpt-oss's fields reach the TransformerConfig: sinks, biases everywhere, the clamped SwiGLU, and YaRN's attention
    factor m as the softmax scale's m² (transformers scales cos and sin by m); the summary names the sinks' and the
    windows' kernels; the layout check refuses expert TP, which cannot hold the experts' biases (through the real
    command, with sequential experts too: test_training.py); quantizations other than MXFP4 are refused."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from llamafactory_mca.errors import UserError
    from llamafactory_mca.models.config import rope_attention_scaling
    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.models.spec import describe_kernels
    from llamafactory_mca.parallel import check_layout
    from llamafactory_mca.tools.tiny import tiny_hf_config

    hf = tiny_hf_config("gpt_oss")
    mca = get_family("gpt_oss").config_from_hf(hf)
    m = rope_attention_scaling(hf)
    assert m == pytest.approx(0.1 * math.log(4.0) + 1)  # YaRN's default attention factor for factor 4
    config = mca.to_transformer_config({}, use_cpu_initialization=True)
    assert config.softmax_scale == pytest.approx(16 ** -0.5 * m * m)
    assert config.softmax_type == "learnable" and config.add_bias_linear and config.add_qkv_bias
    assert config.activation_func is quick_gelu and config.glu_linear_offset == 1.0
    assert config.activation_func_clamp_value == 7.0 and config.moe_grouped_gemm
    assert config.moe_router_pre_softmax is False and config.window_attn_skip_freq == [1, 0, 1, 0]
    line = describe_kernels(config)
    assert "layer spec: native" in line and "attention sinks (learnable): fp32 scores per sequence" in line, line
    assert "sliding window 6 tokens on 2 of 4 layers" in line, line
    with pytest.raises(UserError, match="expert_tensor_parallel_size=2: the experts' biases need each expert whole"):
        check_layout(mca, dataclasses.replace(_layout(world=4, tp=2), etp=2), sequence_parallel=True)
    with pytest.raises(ValueError, match="a gptq quantized checkpoint"):
        get_family("gpt_oss").config_from_hf(tiny_hf_config("gpt_oss", quantization_config={"quant_method": "gptq"}))
    mxfp4 = get_family("gpt_oss").config_from_hf(tiny_hf_config("gpt_oss", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}))
    assert "quantization_config" not in mxfp4.hf_config  # exported weights are bf16


def test_mxfp4_experts_read_dequantized_as_transformers_does(tmp_path):
    """The hub's gpt-oss experts in MXFP4 (``_blocks`` / ``_scales``) read as transformers' dequantized bf16 tensor
    ([E, in, out]), whole or one expert at a time; other tensors as stored."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from llamafactory_mca.checkpoints.hf_io import SafetensorsSource

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 96, 2, 16), dtype=torch.uint8, generator=g)  # [E, out 96, in 64 / 32, 16]
    scales = torch.randint(118, 132, (3, 96, 2), dtype=torch.uint8, generator=g)
    bias = torch.randn(3, 96, generator=g)
    save_file({"x.gate_up_proj_blocks": blocks, "x.gate_up_proj_scales": scales, "x.gate_up_proj_bias": bias},
              str(tmp_path / "model.safetensors"))
    src = SafetensorsSource(str(tmp_path))
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert src.shape("x.gate_up_proj") == tuple(want.shape) == (3, 64, 96)
    assert torch.equal(src.get("x.gate_up_proj"), want)
    assert torch.equal(src.get("x.gate_up_proj", 0, 1, 2), want[1:2])
    assert torch.equal(src.get("x.gate_up_proj", 2, 10, 20), want[..., 10:20])
    assert torch.equal(src.get("x.gate_up_proj_bias"), bias)
    with pytest.raises(KeyError):
        src.get("x.down_proj")
