"""The native layer spec on one CUDA GPU, bf16: the CPU suite's parity checks plus the kernels only CUDA runs
(varlen_attn, bf16 torch._grouped_mm) and the memory claim (attention memory linear in tokens).

Run: ``python -m pytest tests/gpu/test_native_gpu.py -q`` (skipped without CUDA).
"""

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB, SEQ, BATCH = 256, 256, 2
THD_LENGTHS = (128, 320, 64, 256)


def _layout(world=1, cp=1):
    from llamafactory_mca.parallel import ParallelLayout

    return ParallelLayout(world_size=world, tp=1, pp=1, vpp=None, cp=cp, ep=1, etp=1, dp=world // cp,
                          expert_dp=world, micro_batch_size=1, grad_accum=1)


def _config(moe=False, dtype=torch.bfloat16, backend=None, **extra):
    from megatron.core.transformer import TransformerConfig

    from llamafactory_mca.models import spec

    kwargs = dict(
        num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2, kv_channels=32, ffn_hidden_size=512,
        normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=True,
        bf16=dtype is torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype,
    )
    if moe:
        kwargs.update(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, moe_grouped_gemm=True,
                      moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", moe_aux_loss_coeff=0.0)
    if backend:
        kwargs["attention_backend"] = backend
    kwargs.update(extra)
    spec.prepare_config(kwargs)
    return TransformerConfig(**kwargs)


def _model(config):
    import os

    from megatron.core.models.gpt import GPTModel

    from llamafactory_mca.models import spec

    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)  # Megatron pins them per backend; these tests build local and native models
    return GPTModel(config, spec.get_layer_spec(config), vocab_size=VOCAB, max_sequence_length=1024,
                    position_embedding_type="rope").cuda()


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))


def _sequential_to_grouped(state: dict, num_experts: int) -> dict:
    out = {k: v for k, v in state.items() if ".local_experts." not in k}
    for layer in sorted({k.split(".mlp.")[0] for k in state if ".local_experts." in k}):
        fc1 = [state[f"{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(num_experts)]
        fc2 = [state[f"{layer}.mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(num_experts)]
        out[f"{layer}.mlp.experts.weight1"] = torch.stack([w.t() for w in fc1]).reshape(fc1[0].size(1), -1)
        out[f"{layer}.mlp.experts.weight2"] = torch.stack([w.t() for w in fc2]).reshape(-1, fc2[0].size(0))
    return out


def _forward(model, tokens, params=None, positions=None):
    if positions is None:
        positions = torch.arange(tokens.size(1), device="cuda").expand(tokens.size(0), -1)
    return model(tokens, positions, None, packed_seq_params=params)


def _parity_suite() -> dict:
    """bf16 native and bf16 local against an fp32 local reference, same weights: native may not be worse."""
    from llamafactory_mca import parallel

    parallel.initialize(_layout(), seed=3)
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    res = {}
    for name, moe in (("dense", False), ("moe", True)):
        torch.manual_seed(0)
        reference = _model(_config(moe=moe, dtype=torch.float32, backend="local", moe_grouped_gemm=False))
        state = reference.state_dict()
        local = _model(_config(moe=moe, backend="local", moe_grouped_gemm=False))
        local.load_state_dict(state, strict=False)
        native = _model(_config(moe=moe))
        native.load_state_dict(_sequential_to_grouped(state, 8) if moe else state, strict=False)
        ref = _forward(reference, tokens)
        res[f"{name}_local_err"] = _rel(_forward(local, tokens), ref)
        res[f"{name}_native_err"] = _rel(_forward(native, tokens), ref)
    return res


def _packed_suite() -> dict:
    """Packed THD (varlen_attn) vs per-sequence padded forwards (SDPA), bf16, logits and gradients. Dense: in bf16
    a MoE router may flip a near-tie top-k choice between the two runs, which moves single logits a lot."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from llamafactory_mca import parallel

    parallel.initialize(_layout(), seed=3)
    torch.manual_seed(0)
    model = _model(_config())
    cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed = torch.randint(0, VOCAB, (1, int(cu[-1])), device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in THD_LENGTHS]).unsqueeze(0)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(THD_LENGTHS),
                             max_seqlen_kv=max(THD_LENGTHS))
    out = _forward(model, packed, params, positions)
    out.float().pow(2).mean().backward()
    packed_grad = model.decoder.layers[0].self_attention.linear_qkv.weight.grad.clone()
    model.zero_grad()
    pieces = [_forward(model, packed[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    torch.cat(pieces, 1).float().pow(2).mean().backward()
    return {"logits": _rel(out, torch.cat(pieces, 1)),
            "qkv_grad": _rel(packed_grad, model.decoder.layers[0].self_attention.linear_qkv.weight.grad)}


def _wgrad_suite() -> dict:
    """Megatron's ColumnParallelLinear with gradient_accumulation_fusion through models/native/wgrad.py (installed by
    models.native.install in apex's place): main_grad gets dy^T x in fp32, no bf16 .grad is made, twice in a row
    accumulates."""
    from megatron.core.tensor_parallel import layers

    from llamafactory_mca import parallel

    parallel.initialize(_layout(), seed=3)
    config = _config(gradient_accumulation_fusion=True)
    assert config.gradient_accumulation_fusion and layers._grad_accum_fusion_available
    linear = layers.ColumnParallelLinear(256, 512, config=config, init_method=config.init_method, bias=False,
                                         gather_output=False).cuda()
    weight = linear.weight
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device="cuda")
    weight.grad_added_to_main_grad = False
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    expected = torch.zeros_like(weight.main_grad)
    for _ in range(2):
        out, _ = linear(x)
        dy = torch.randn_like(out)
        out.backward(dy)
        expected += dy.reshape(-1, 512).float().t() @ x.detach().reshape(-1, 256).float()
    return {"err": _rel(weight.main_grad, expected), "added": weight.grad_added_to_main_grad}


def test_wgrad_accumulation_fusion_without_apex():
    res = run_distributed(_wgrad_suite, 1)[0]
    assert res["added"] and res["err"] < 1e-2, res


def test_embedding_rows_into_main_grad_on_cuda():
    """The word embeddings' backward on CUDA (``native/embedding.py``): a bf16 table of Qwen3's vocabulary, two
    micro-batches' rows added into an fp32 main_grad (one token repeated) against the fp32 sum of torch's dense
    gradients; the placeholder gradient made, nothing else."""
    from llamafactory_mca.models.native.embedding import lookup

    gen = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(151936, 256, device="cuda", generator=gen).to(torch.bfloat16))
    weight.main_grad = torch.zeros(weight.shape, device="cuda")
    weight.grad_added_to_main_grad = False
    dense, expected = weight.detach().clone().requires_grad_(), torch.zeros(weight.shape, device="cuda")
    for _ in range(2):
        ids = torch.randint(0, 151936, (2, 2048), device="cuda", generator=gen)
        ids[1, :100] = ids[0, 0]
        grad = torch.randn(2, 2048, 256, device="cuda", generator=gen).to(torch.bfloat16)
        lookup(ids, weight).backward(grad)
        F.embedding(ids, dense).backward(grad)
        expected += dense.grad.float()
        dense.grad = None
    assert weight.grad_added_to_main_grad and weight.grad.shape == weight.shape
    assert _rel(weight.main_grad, expected) < 1e-2


def test_tied_table_makes_no_table_sized_op_under_fused_accumulation():
    """The CPU suite's tied table (``test_tied_table_takes_one_gradient_per_micro_batch``) where the output layer fuses
    its weight gradient into ``main_grad``: the same gradient in bf16, and the backward makes no table-sized op at
    all (the output layer's placeholder is not zeroed, the lookup hands autograd nothing, DDP's hook adds nothing)."""
    from tests.models.test_native_spec import _tied_table_run

    res = run_distributed(_tied_table_run, 1, True)[0]
    assert res["rel"] < 1e-2 and res["table_ops"] == [] and not res["zero_out"], res


def test_bf16_parity_native_vs_local():
    res = run_distributed(_parity_suite, 1)[0]
    for name in ("dense", "moe"):
        assert res[f"{name}_native_err"] <= 2 * res[f"{name}_local_err"] + 1e-2, res


def test_bf16_packed_equals_per_sequence():
    res = run_distributed(_packed_suite, 1)[0]
    assert res["logits"] <= 3e-2 and res["qkv_grad"] <= 5e-2, res


def test_varlen_signature_and_causal_kwargs():
    from llamafactory_mca.models.native import kernels

    assert kernels.varlen_attn_available(), f"torch {torch.__version__} has no torch.nn.attention.varlen"
    kwargs = dict(kernels._varlen_causal_kwargs(True))
    assert kwargs.get("window_size") == (-1, 0) or kwargs.get("is_causal") is True, kwargs


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_varlen_segments_match_causal_attention(cp, window):
    """varlen_attn with the CP plan (non-square, bottom-right causal segments) == per-sequence causal SDPA; with a
    sliding window (each query sees itself and the ``window`` keys before it) through varlen_attn's own
    ``window_size``, against SDPA with the band as its mask; a padded batch takes the same window."""
    from llamafactory_mca.data.context_parallel import local_token_index
    from llamafactory_mca.models.native.context_parallel import packed_plan
    from llamafactory_mca.models.native.kernels import padded_attention, segment_attention, varlen_usable

    lengths = [2 * cp * n for n in (96, 160, 32, 256)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    g = torch.Generator(device="cuda").manual_seed(0)
    total = int(cu[-1])
    q = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    assert window is None or varlen_usable(q, window), f"torch {torch.__version__}: no varlen window_size"

    def reference(a: int, b: int) -> torch.Tensor:
        seen = torch.ones(b - a, b - a, dtype=torch.bool, device="cuda").tril()
        if window is not None:
            seen &= ~torch.ones(b - a, b - a, dtype=torch.bool, device="cuda").tril(-window - 1)
        return F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                              attn_mask=seen, enable_gqa=True).transpose(0, 1)

    ref = torch.cat([reference(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    index = [local_token_index(cu, r, cp).cuda() for r in range(cp)]
    gathered_k, gathered_v = torch.cat([k[i] for i in index]), torch.cat([v[i] for i in index])
    for r in range(cp):
        plan = packed_plan(cu, r, cp, len(index[r]), torch.device("cuda"))
        kk = gathered_k[plan.kv_index] if cp > 1 else k
        vv = gathered_v[plan.kv_index] if cp > 1 else v
        out = segment_attention(q[index[r]], kk, vv, plan, scale=128 ** -0.5, window=window)
        torch.testing.assert_close(out, ref[index[r]], atol=2e-2, rtol=2e-2)
    if cp == 1:
        a, b = cu[1].item(), cu[2].item()
        out = padded_attention(q[a:b, None], k[a:b, None], v[a:b, None], 128 ** -0.5, True, window=window)
        torch.testing.assert_close(out[:, 0], reference(a, b).reshape(b - a, -1), atol=2e-2, rtol=2e-2)


def test_one_sequence_through_cudnn_equals_varlen():
    """A packed micro-batch of one sequence (and a padded causal batch) through cuDNN's fused attention where the GPU
    takes it: output and q/k/v gradients equal varlen_attn's (flash) to bf16 tolerance."""
    from llamafactory_mca.models.native.kernels import make_plan, one_sequence, padded_attention, segment_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4096, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for h in (16, 8, 8))
    grad = torch.randn(4096, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    plan = make_plan([4096], [4096], torch.device("cuda"))
    ref = segment_attention(q, k, v, plan, 128 ** -0.5)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    if torch.cuda.get_device_capability()[0] < 9:
        assert one_sequence(q, k, v, 128 ** -0.5) is None
        pytest.skip("cuDNN attention is used from compute capability 9 (Hopper) on")
    out = one_sequence(q, k, v, 128 ** -0.5)
    assert out is not None, f"cuDNN not taken: torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"
    torch.testing.assert_close(out.view_as(ref), ref, atol=2e-2, rtol=2e-2)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), grad.view_as(out)), ref_grads):
        assert ((mine.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item() < 2e-2
    padded = padded_attention(q.view(2048, 2, 16, 128), k.view(2048, 2, 8, 128), v.view(2048, 2, 8, 128),
                              128 ** -0.5, True)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
        flash = F.scaled_dot_product_attention(*(t.view(2048, 2, -1, 128).permute(1, 2, 0, 3) for t in (q, k, v)),
                                               is_causal=True, enable_gqa=True)
    torch.testing.assert_close(padded, flash.permute(2, 0, 1, 3).reshape(2048, 2, -1), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 100])
def test_varlen_sinks_match_the_scores_path(window):
    """Attention sinks through varlen_attn (its forward's log-sum-exp, its backward handed the sink-adjusted output
    and log-sum-exp) == the same in fp32 scores per sequence (the path checked against transformers' eager attention
    on CPU): outputs and the gradients of queries, keys, values and the sinks, packed, GQA, with a window."""
    from llamafactory_mca.models.native.kernels import _scores_per_segment, make_plan, segment_attention, varlen_usable

    lengths = [192, 320, 64, 512]
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (16, 4, 4))
    sink = torch.randn(16, device="cuda", dtype=torch.bfloat16, generator=g)
    grad = torch.randn(total, 16, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    assert varlen_usable(q, window)
    plan = make_plan(lengths, lengths, torch.device("cuda"))
    results = []
    for fp32 in (False, True):
        leaves = [t.detach().float().requires_grad_() if fp32 else t.detach().clone().requires_grad_()
                  for t in (q, k, v, sink)]
        attend = _scores_per_segment if fp32 else segment_attention
        out = attend(*leaves[:3], plan, 64 ** -0.5, window, leaves[3])
        out.backward(grad.float() if fp32 else grad)
        results.append([out.float()] + [t.grad.float() for t in leaves])
    for name, ours, want in zip(["out", "dq", "dk", "dv", "dsink"], *results):
        scale = float(want.abs().max())
        assert float((ours - want).abs().max()) <= 2e-2 * scale, (name, float((ours - want).abs().max()), scale)


def _experts_suite() -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from llamafactory_mca import parallel
    from llamafactory_mca.models.native.experts import NativeGroupedMLP, grouped_mm_usable

    parallel.initialize(_layout(), seed=3)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    config = _config(moe=True)
    torch.manual_seed(0)
    seq = SequentialMLP(8, config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                        pg_collection=pgs).cuda()
    grouped = NativeGroupedMLP(8, config, pg_collection=pgs).cuda()
    prefixed = {f"x.mlp.experts.{k}": v for k, v in seq.state_dict().items()}
    grouped.load_state_dict({k.removeprefix("x.mlp.experts."): v
                             for k, v in _sequential_to_grouped(prefixed, 8).items()}, strict=False)
    counts = torch.tensor([37, 0, 211, 5, 0, 64, 1, 130])  # ragged, with empty experts
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(int(counts.sum()), device="cuda")
    grad = torch.randn_like(x)
    outs = {}
    for label, module in (("seq", seq), ("grouped", grouped)):
        xi = x.clone().requires_grad_()
        y, _ = module(xi, counts, probs)
        y.backward(grad)
        outs[label] = (y, xi.grad)
    fc1 = torch.stack([seq.local_experts[e].linear_fc1.weight.grad.t() for e in range(8)])
    # gradient_accumulation_fusion: the same experts add their weight gradients to an fp32 main_grad in the
    # backward (the compiled add), two micro-batches in a row, and leave the placeholder as .grad
    fused_config = copy.copy(config)
    fused_config.gradient_accumulation_fusion = True
    fused = NativeGroupedMLP(8, fused_config, pg_collection=pgs).cuda()
    fused.load_state_dict(grouped.state_dict())
    for param in fused.parameters():
        param.main_grad = torch.zeros(param.shape, device="cuda", dtype=torch.float32)
        param.grad_added_to_main_grad = False
    for _ in range(2):
        xi = x.clone().requires_grad_()
        fused(xi, counts, probs)[0].backward(grad)
    return {"kernel": grouped_mm_usable(x, grouped.weight1.view(8, 256, -1)),
            "out": _rel(outs["grouped"][0], outs["seq"][0]), "dx": _rel(outs["grouped"][1], outs["seq"][1]),
            "dw1": _rel(grouped.weight1.grad.view(8, 256, -1), fc1),
            "empty_dw1": float(grouped.weight1.grad.view(8, 256, -1)[[1, 4]].abs().max()),
            "fused_dx": _rel(xi.grad, outs["grouped"][1]),
            "fused_dw1": _rel(fused.weight1.main_grad, 2 * grouped.weight1.grad.float()),
            "fused_dw2": _rel(fused.weight2.main_grad, 2 * grouped.weight2.grad.float()),
            "fused_flags": all(p.grad_added_to_main_grad for p in fused.parameters())}


def test_bf16_grouped_mm_experts_equal_sequential():
    res = run_distributed(_experts_suite, 1)[0]
    assert res["kernel"], "torch._grouped_mm was not used for bf16 on this GPU"
    assert res["out"] <= 2e-2 and res["dx"] <= 2e-2 and res["dw1"] <= 2e-2, res
    assert res["empty_dw1"] == 0.0, res
    assert res["fused_flags"] and res["fused_dx"] == 0.0, res
    assert res["fused_dw1"] <= 1e-2 and res["fused_dw2"] <= 1e-2, res


@pytest.mark.parametrize("k,n", [(256, 384), (96, 200)])
def test_grouped_wgrad_adds_into_main_grad_in_fp32(k, n):
    """The experts' Triton weight-gradient GEMM: main_grad[e] += x_e^T g_e over ragged groups (an empty expert, groups
    that are no multiple of the 64-row step, sizes that are no multiple of the tiles), against fp32 matmuls; an
    expert without rows is left as it was."""
    from llamafactory_mca.models.native.grouped_wgrad import grouped_wgrad_accumulate

    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [70, 0, 1, 256, 129, 64]
    rows = sum(counts)
    x = torch.randn(rows + 5, k, device="cuda", generator=gen).bfloat16()  # rows past the last group are no expert's
    g = torch.randn(rows + 5, n, device="cuda", generator=gen).bfloat16()
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    main_grad = torch.randn(len(counts), k, n, device="cuda", generator=gen)
    expected = main_grad.clone()
    start = 0
    for e, c in enumerate(counts):
        expected[e] += x[start:start + c].float().t() @ g[start:start + c].float()
        start += c
    untouched = main_grad[1].clone()
    grouped_wgrad_accumulate(x, g, ends, main_grad)
    assert torch.equal(main_grad[1], untouched)
    torch.testing.assert_close(main_grad, expected, rtol=1e-5, atol=1e-4)


def _close_to_fp32(gen, triton_fn, eager_fn, x, *extra):
    """``triton_fn`` in bf16 against ``eager_fn`` in fp32 on the same bf16 inputs and output gradient: outputs and
    input gradients within bf16 rounding of the largest value."""
    inputs = [x.bfloat16(), *[e.bfloat16() for e in extra]]
    grad, out = None, []
    for fn, dtype in ((triton_fn, torch.bfloat16), (eager_fn, torch.float32)):
        xs = [i.detach().to(dtype).requires_grad_() for i in inputs]
        y = fn(*xs)
        grad = torch.randn(y.shape, device="cuda", generator=gen).bfloat16() if grad is None else grad
        y.backward(grad.to(dtype))
        out.append([y.float(), *[i.grad.float() for i in xs]])
    for a, b in zip(*out, strict=True):
        assert (a - b).abs().max().item() <= 1e-2 * max(1.0, b.abs().max().item()), (a - b).abs().max()


def test_triton_norm_and_rope_against_fp32():
    """The q/k norm, the (1 + weight) norm and RoPE as Triton kernels, bf16 on the GPU, against the eager functions in
    fp32 on the same bf16 inputs and output gradient (forward and backward, q read from a strided view of a fused
    QKV, packed positions and padded): within bf16 rounding; the weight gradient reduced over 8k-16k rows. Also
    Gemma 4's norm without weight, CUDA's fused kernel taking bf16 as it is."""
    from llamafactory_mca.models.native import norm, norm_triton, rope, rope_triton, sublayers

    gen = torch.Generator(device="cuda").manual_seed(0)
    close = partial(_close_to_fp32, gen)

    qkv = torch.randn(1024, 1, 4, 4 * 128, device="cuda", generator=gen)
    weight = 1 + torch.randn(128, device="cuda", generator=gen) / 4
    q = lambda x: x[..., :256].unflatten(-1, (2, 128)).flatten(2, 3)  # noqa: E731 (Megatron's q view: 8 heads)
    close(lambda x, w: norm_triton.rms_norm(q(x), w, 1e-6), lambda x, w: norm._head_rms_norm(q(x), w, 1e-6), qkv,
          weight)
    close(lambda x, w: norm_triton.rms_norm(x, w, 1e-6, 1.0), lambda x, w: norm._zero_centred_rms_norm(x, w, 1e-6),
          torch.randn(512, 2, 2048, device="cuda", generator=gen), weight.repeat(16) / 4)
    # MiniMax-M2's norms across all heads of a token: 48 query heads (6,144 wide), 8 key heads strided after the split
    wide = torch.randn(1024, 1, 8, 8 * 128, device="cuda", generator=gen)
    for view in (lambda x: x[..., :768].unflatten(-1, (6, 128)).flatten(2, 3), lambda x: x[..., 768:896]):
        w = 1 + torch.randn(view(wide)[0, 0].numel(), device="cuda", generator=gen) / 4
        close(lambda x, w, view=view: norm_triton.rms_norm(view(x).flatten(-2), w, 1e-6).view_as(view(x)),
              lambda x, w, view=view: norm._across_heads_rms_norm(view(x), w, w.numel(), 1e-6), wide, w)
    # Gemma 4's values: a norm without weight on a key/value head strided after the split
    close(lambda x: sublayers._rms(x[..., 384:], 1e-6),
          lambda x: torch.nn.functional.rms_norm(x[..., 384:], (128,), eps=1e-6), qkv)
    cu = torch.tensor([0, 100, 612, 1024], device="cuda")
    positions = rope.thd_positions(cu, 1024, 1, 0, False)
    freqs = torch.randn(2048, 1, 1, 128, device="cuda", generator=gen) * 4
    close(lambda x: rope_triton.rotate(q(x).squeeze(1), freqs, positions),
          lambda x: rope._rotate(q(x).squeeze(1), freqs, positions, False), qkv)
    close(lambda x: rope_triton.rotate(x, freqs[:64, :, :, :64], None),
          lambda x: rope._rotate(x, freqs[:64, :, :, :64], None, False),
          torch.randn(64, 2, 8, 128, device="cuda", generator=gen))


def test_triton_kernels_compile_once_for_q_k_directions_and_row_counts():
    """Step 1 on a fresh machine compiles each Triton kernel once: q and k (16 and 8 heads), forward and backward, and
    row counts divisible by 16 or not share one compiled norm, rotation and SwiGLU (widths no other test uses, so each
    is new to this process)."""
    from llamafactory_mca.models.native import norm_triton, rope_triton, swiglu_triton
    from llamafactory_mca.trainer import metrics

    metrics.record_triton_compiles()
    before = len(metrics._TRITON_COMPILES)
    freqs = torch.randn(4096, 1, 1, 72, device="cuda")
    weight = torch.ones(72, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for heads, tokens in ((16, 4096), (8, 4095), (16, 17)):
        x = torch.randn(tokens, heads, 72, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = rope_triton.rotate(norm_triton.rms_norm(x, weight, 1e-6), freqs, torch.arange(tokens, device="cuda"))
        y.float().sum().backward()
        h = torch.randn(tokens, 2 * 176, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        swiglu_triton.swiglu(h).float().sum().backward()
    names = sorted(name for _, name, _ in metrics._TRITON_COMPILES[before:])
    assert names == ["norm_triton._backward", "norm_triton._forward", "rope_triton._rotate",
                     "swiglu_triton._backward", "swiglu_triton._forward"], names


def test_triton_swiglu_loss_and_combine_against_fp32():
    """SwiGLU (plain at a dense MLP's width, weighted at the experts' 768 with 8k rows), GeGLU at Gemma 4 E2B's double
    width and on its per-layer inputs (gate and vector apart, the vector strided), the loss's two passes over a
    151,936-word vocabulary and over Gemma 4's 262,144 soft-capped at 30, and the MoE combine, Triton in bf16 against
    eager fp32 (the loss: torch's cross-entropy on the same logits, capped as transformers caps them), forward and
    backward."""
    from llamafactory_mca.models.native import combine_triton, cross_entropy, swiglu_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    close = partial(_close_to_fp32, gen)

    def eager_swiglu(x, w=None):
        a, b = x.chunk(2, -1)
        return torch.nn.functional.silu(a) * b * (1 if w is None else w)

    close(swiglu_triton.swiglu, eager_swiglu, torch.randn(1024, 2 * 6144, device="cuda", generator=gen))
    close(swiglu_triton.swiglu, eager_swiglu, torch.randn(8192, 2 * 768, device="cuda", generator=gen),
          torch.rand(8192, 1, device="cuda", generator=gen))

    def eager_geglu(x):
        a, b = x.chunk(2, -1)
        return torch.nn.functional.gelu(a, approximate="tanh") * b

    close(swiglu_triton.geglu, eager_geglu, torch.randn(4096, 2 * 12288, device="cuda", generator=gen) * 2)
    vectors = torch.randn(8192, 35, 256, device="cuda", generator=gen)  # E2B's per-layer inputs: one layer's, strided
    close(lambda g, v: swiglu_triton.gelu_times(g, v[:, 3]),
          lambda g, v: torch.nn.functional.gelu(g, approximate="tanh") * v[:, 3],
          torch.randn(8192, 256, device="cuda", generator=gen) * 2, vectors)
    target = torch.randint(0, 151936, (1024,), device="cuda", generator=gen)
    close(lambda x: cross_entropy.vocab_parallel_cross_entropy(x, target),
          lambda x: torch.nn.functional.cross_entropy(x, target, reduction="none"),
          torch.randn(1024, 151936, device="cuda", generator=gen) * 3)
    target = torch.randint(0, 262144, (1024,), device="cuda", generator=gen)  # Gemma 4's vocabulary, capped at 30
    close(lambda x: cross_entropy.vocab_parallel_cross_entropy(x, target, cap=30.0),
          lambda x: torch.nn.functional.cross_entropy(torch.tanh(x / 30.0) * 30.0, target, reduction="none"),
          torch.randn(1024, 262144, device="cuda", generator=gen) * 20)
    rows = torch.randn(4096 * 8, 2048, device="cuda", generator=gen).bfloat16()
    rows_of_token = torch.randperm(4096 * 8, device="cuda")
    exact = rows.float()[rows_of_token].view(4096, 8, 2048).sum(1)  # the fp32 sum it rounds once
    torch.testing.assert_close(combine_triton.gather_sum(rows, rows_of_token, 8).float(), exact, rtol=2**-8, atol=1e-5)


def _attention_memory(token_counts) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from llamafactory_mca import parallel
    from llamafactory_mca.models.native.attention import NativeDotProductAttention

    parallel.initialize(_layout(), seed=3)
    config = _config(num_attention_heads=16, num_query_groups=4, kv_channels=128, hidden_size=2048)
    attention = NativeDotProductAttention(config, 1, AttnMaskType.causal, "self")
    peaks = {}
    for layout in ("packed", "padded"):
        for n in token_counts:
            shape = (n, 1) if layout == "padded" else (n,)  # padded: one sequence of n; packed: two of n/2
            q = torch.randn(*shape, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(*shape, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(*shape, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(*shape, 16 * 128, device="cuda", dtype=torch.bfloat16)
            params = None
            if layout == "packed":
                cu = torch.tensor([0, n // 2, n], dtype=torch.int32, device="cuda")
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n // 2,
                                         max_seqlen_kv=n // 2)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            attention(q, k, v, None, packed_seq_params=params).backward(grad)
            torch.cuda.synchronize()
            peaks[(layout, n)] = torch.cuda.max_memory_allocated() - base
            del q, k, v, grad
    return peaks


def test_attention_memory_is_linear_in_tokens():
    """8k → 16k → 32k tokens: quadratic attention grows 4x per doubling, linear 2x (slack for the allocator)."""
    peaks = run_distributed(_attention_memory, 1, (8192, 16384, 32768))[0]
    for layout in ("packed", "padded"):
        assert peaks[(layout, 16384)] <= 2.5 * peaks[(layout, 8192)], peaks
        assert peaks[(layout, 32768)] <= 2.5 * peaks[(layout, 16384)], peaks


def _cp_inputs():
    g = torch.Generator(device="cuda").manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    weights = torch.randn(BATCH, SEQ, VOCAB, device="cuda", generator=g)
    cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed = torch.randint(0, VOCAB, (1, int(cu[-1])), device="cuda", generator=g)
    packed_weights = torch.randn(1, int(cu[-1]), VOCAB, device="cuda", generator=g)
    positions = torch.cat([torch.arange(n, device="cuda") for n in THD_LENGTHS]).unsqueeze(0)
    return tokens, weights, cu, packed, packed_weights, positions


def _thd(cu):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(THD_LENGTHS),
                           max_seqlen_kv=max(THD_LENGTHS))


def _cp_run(ckpt: str, cp: int) -> dict:
    """cp=1 saves the reference checkpoint; cp=2 loads it. Logits per rank and the CP-summed qkv gradient."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from llamafactory_mca import parallel
    from llamafactory_mca.data.context_parallel import split_for_context_parallel

    parallel.initialize(_layout(world=cp, cp=cp), seed=3)
    torch.manual_seed(0)
    model = _model(_config(context_parallel_size=cp))
    if cp == 1:
        os.makedirs(ckpt, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt), strict=False)
    rank, group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()
    tokens, weights, cu, packed, packed_weights, positions = _cp_inputs()
    out = {}
    for kind in ("padded", "thd"):
        model.zero_grad()
        if kind == "padded":
            local = split_for_context_parallel({"t": tokens, "w": weights}, None, rank, cp)
            logits = _forward(model, local["t"])
        else:
            local = split_for_context_parallel({"t": packed, "w": packed_weights, "p": positions}, cu, rank, cp)
            logits = _forward(model, local["t"], _thd(cu), local["p"])
        (logits.float() * local["w"]).sum().backward()
        grad = model.decoder.layers[1].self_attention.linear_qkv.weight.grad.float()
        torch.distributed.all_reduce(grad, group=group)
        out[kind] = {"logits": logits.detach().float().cpu(), "qkv_grad": grad.cpu()}
    return out


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cp2_bf16_equals_cp1(tmp_path):
    from llamafactory_mca.data.context_parallel import local_token_index

    ref = run_distributed(_cp_run, 1, str(tmp_path / "ckpt"), 1)[0]
    per_rank = run_distributed(_cp_run, 2, str(tmp_path / "ckpt"), 2)
    cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()])
    for kind in ("padded", "thd"):
        full = torch.empty_like(ref[kind]["logits"])
        for rank, out in enumerate(per_rank):
            if kind == "padded":
                chunks = full.view(BATCH, 4, SEQ // 4, VOCAB)
                chunks[:, [rank, 3 - rank]] = out[kind]["logits"].view(BATCH, 2, SEQ // 4, VOCAB)
            else:
                full[:, local_token_index(cu, rank, 2)] = out[kind]["logits"]
        assert _rel(full, ref[kind]["logits"]) <= 2e-2, (kind, _rel(full, ref[kind]["logits"]))
        assert _rel(per_rank[0][kind]["qkv_grad"], ref[kind]["qkv_grad"]) <= 5e-2, kind


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_varlen_equals_its_sdpa_pieces(name):
    """The towers' attention in one varlen_attn call per block against transformers' SDPA call per image / window,
    bf16 on the GPU: outputs and the pixels' gradients (a tower that trains)."""
    from llamafactory_mca.models.multimodal import build_vision_tower
    from llamafactory_mca.tools.tiny import tiny_hf_config

    hf = tiny_hf_config(name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ours = build_vision_tower(hf.to_dict(), torch.bfloat16)
        theirs = type(ours)._from_config(hf.vision_config, dtype=torch.bfloat16, attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    grid = torch.tensor([[1, 8, 8], [1, 16, 8], [2, 8, 8]], device="cuda")
    v = hf.vision_config
    pixels = torch.randn(int(grid.prod(-1).sum()), v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
                         device="cuda", dtype=torch.bfloat16)
    results = []
    for tower in (ours, theirs):
        x = pixels.clone().requires_grad_()
        out = tower(x, grid_thw=grid)
        out = getattr(out, "pooler_output", out)
        out.float().square().mean().backward()
        results.append((out.float(), x.grad.float()))
    assert _rel(results[0][0], results[1][0]) <= 1e-2
    assert _rel(results[0][1], results[1][1]) <= 3e-2


def test_wide_heads_attention_against_fp32_and_faster_than_sdpa():
    """Packed attention with heads of 512 (Gemma 4's full-attention layers; one key/value head for 8 queries, the
    E2B's), which flash and cuDNN refuse: the tensor-core path in bf16 against SDPA in fp32 on the same inputs, forward
    and backward, and faster than what SDPA ran there before (its math fallback, fp32)."""
    import time

    from llamafactory_mca.models.native.kernels import make_plan, segment_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    plan = make_plan([1024, 512, 2048, 512], [1024, 512, 2048, 512], torch.device("cuda"))
    q, k, v = (torch.randn(4096, heads, 512, device="cuda", generator=gen) for heads in (8, 1, 1))
    q, k = (t / t.square().mean(-1, keepdim=True).sqrt() for t in (q, k))  # normed, as Gemma 4's q/k norms leave them

    def run(dtype, fn):  # both on the same bf16 values
        xs = [t.bfloat16().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        out.backward(torch.cos(out.detach()))
        return [out.float(), *[x.grad.float() for x in xs]]

    def reference(q, k, v):
        outs, start = [], 0
        for n in plan.q_lens:
            piece = [t[start:start + n].transpose(0, 1) for t in (q, k, v)]
            outs.append(torch.nn.functional.scaled_dot_product_attention(*piece, is_causal=True, scale=1.0,
                                                                         enable_gqa=True).transpose(0, 1))
            start += n
        return torch.cat(outs)

    ours = run(torch.bfloat16, lambda q, k, v: segment_attention(q, k, v, plan, 1.0))
    for a, b in zip(ours, run(torch.float32, reference), strict=True):
        assert (a - b).abs().max().item() <= 1e-2 * b.abs().max().item(), (a - b).abs().max()

    def seconds(fn) -> float:
        run(torch.bfloat16, fn)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            run(torch.bfloat16, fn)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 5

    assert seconds(lambda q, k, v: segment_attention(q, k, v, plan, 1.0)) < seconds(reference)
