"""FP8 without Transformer Engine (models/native/fp8.py): the scaled GEMMs against the matmuls they replace, the
layers they cover, Megatron's communication around them under TP2 + SP, and the keys that turn them on.

On CPU torch's ``_scaled_mm`` computes the same FP8 products as on a GPU (the casts are the torch fallback of the
Triton kernel, which tests/gpu/test_fp8_gpu.py holds to it bit for bit); the refusal of FP8 on machines without FP8
tensor cores is in tests/test_args.py."""

import contextlib
import dataclasses

import pytest
import torch

from tests._dist import run_distributed


def _fp8():
    from llamafactory_mca.models.native import fp8

    return fp8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _dequantized(op) -> torch.Tensor:
    return op.data.float() * op.scale_inv


def _reference(x, w, g, settings, trainable):
    """The same three GEMMs in fp32 on the FP8 values themselves (the operands cast as the recipe casts them): what
    _scaled_mm must give up to its accumulation order and the output's rounding."""
    fp8 = _fp8()
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    if settings.rowwise:
        xr, wr = fp8.per_row(x2, settings.dtype(), 1), fp8.per_row(w, settings.dtype(), 1)
        gr, wc = fp8.per_row(g2, settings.dtype(True), 1), fp8.per_row(w, settings.dtype(), 0)
        gc, xc = fp8.per_row(g2, settings.dtype(True), 0), fp8.per_row(x2, settings.dtype(), 0)
    else:
        xr, xc = fp8.per_tensor(x2, settings.dtype(), cols=True)
        wr, wc = fp8.per_tensor(w, settings.dtype(), cols=True)
        gr, gc = fp8.per_tensor(g2, settings.dtype(True), cols=True)
    y = _dequantized(xr) @ _dequantized(wr).t()
    dx = _dequantized(gr) @ _dequantized(wc).t()
    dw = _dequantized(gc) @ _dequantized(xc).t() if trainable else None
    tokens = x2.shape[0]  # the operands' zero rows (padding to a multiple of 16) off
    assert xr.data.shape[0] % 16 == 0 and not xr.data[tokens:].float().any()
    return y[:tokens], dx[:tokens], dw


RECIPES = [("tensorwise", "e4m3"), ("tensorwise", "hybrid"), ("rowwise", "e4m3"), ("rowwise", "hybrid")]


@pytest.mark.parametrize("recipe,fmt", RECIPES)
@pytest.mark.parametrize("trainable", [True, False], ids=["trained", "frozen"])
def test_scaled_gemms_equal_their_fp8_operands_and_stay_near_bf16(recipe, fmt, trainable):
    check_scaled_gemms(recipe, fmt, trainable, "cpu")


def check_scaled_gemms(recipe: str, fmt: str, trainable: bool, device: str) -> None:
    """Forward, input and weight gradients of one FP8 linear (tests/gpu runs it on CUDA: Triton casts, cuBLAS)."""
    fp8 = _fp8()
    settings = fp8.Fp8Training(format=fmt, recipe=recipe)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(29, 2, 96, generator=gen).to(torch.bfloat16)  # 58 tokens: padded to 64 for the GEMMs
    x[3, 1, 5] = 40.0  # an outlier: tensorwise scales everything by it, rowwise only its row
    w = (torch.randn(48, 96, generator=gen) * 0.05).to(torch.bfloat16)
    g = torch.randn(29, 2, 48, generator=gen).to(torch.bfloat16)
    x, w, g = x.to(device), w.to(device), g.to(device)
    xi, wi = x.clone().requires_grad_(), torch.nn.Parameter(w.clone(), requires_grad=trainable)
    y = fp8._Fp8Linear.apply(xi, wi, None, settings, fp8.WeightCasts(), False, False, False, None)
    y.backward(g)
    want_y, want_dx, want_dw = _reference(x, w, g, settings, trainable)
    assert y.dtype == torch.bfloat16 and y.shape == (29, 2, 48)
    assert _rel(y.reshape(-1, 48), want_y) < 4e-3  # the bf16 output's rounding
    assert _rel(xi.grad.reshape(-1, 96), want_dx) < 4e-3
    exact = [x.float().reshape(-1, 96), w.float(), g.float().reshape(-1, 48)]
    loose = 0.08 if fmt == "hybrid" else 0.05  # E4M3 keeps 3 mantissa bits, E5M2 2
    assert _rel(y.reshape(-1, 48), exact[0] @ exact[1].t()) < loose
    assert _rel(xi.grad.reshape(-1, 96), exact[2] @ exact[1]) < loose
    if trainable:
        assert _rel(wi.grad, want_dw) < 4e-3
        assert _rel(wi.grad, exact[2].t() @ exact[0]) < loose
    else:
        assert wi.grad is None


def test_weight_gradient_goes_into_main_grad_in_fp32_or_bf16():
    """``gradient_accumulation_fusion``: each micro-batch's weight gradient is added to DDP's ``main_grad`` (the
    FP8 GEMM's fp32 output, or with ``fp8_wgrad: false`` the bf16 GEMM accumulating there), and ``.grad`` is
    Megatron's placeholder."""
    fp8 = _fp8()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    g = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    for wgrad in (True, False):
        settings = fp8.Fp8Training(wgrad=wgrad)
        w = torch.nn.Parameter((torch.randn(32, 64, generator=gen) * 0.1).to(torch.bfloat16))
        w.main_grad = torch.ones(32, 64)
        w.grad_added_to_main_grad = False
        for _ in range(2):  # two micro-batches
            fp8._Fp8Linear.apply(x.clone().requires_grad_(), w, None, settings, fp8.WeightCasts(), True, False, False,
                                 None).backward(g)
        want = 1 + 2 * (g.float().t() @ x.float())
        assert _rel(w.main_grad - 1, want - 1) < 0.05, wgrad
        assert w.grad_added_to_main_grad and w.grad.shape == w.shape


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_weights_cast_once_a_step_while_held(recipe, monkeypatch):
    """Inside ``WeightCasts.holding()`` (the trainer's forward and backward of a step) a weight is cast once for
    every micro-batch in each layout, the input gradient's only at the first backward (the end of the first forward,
    where activations peak, holds one FP8 copy), with the results of casting it each time; leaving lets the copies
    go."""
    fp8 = _fp8()
    settings = fp8.Fp8Training(format="hybrid", recipe=recipe)
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(rows, 64, generator=gen).to(torch.bfloat16) for rows in (48, 37, 64)]  # uneven micro-batches
    g = [torch.randn(x.shape[0], 32, generator=gen).to(torch.bfloat16) for x in xs]
    w = torch.nn.Parameter((torch.randn(32, 64, generator=gen) * 0.1).to(torch.bfloat16))
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(32, 64), False
    cast_of_w = []
    real = fp8._cast
    monkeypatch.setattr(fp8, "_cast", lambda x, *a, **k: (cast_of_w.append(x.data_ptr() == w.data_ptr()),
                                                          real(x, *a, **k))[1])

    def step(casts, held: bool):
        w.main_grad.zero_()
        cast_of_w.clear()
        grads, forward_only = [], None
        with casts.holding() if held else contextlib.nullcontext():
            for x, gx in zip(xs, g):
                xi = x.clone().requires_grad_()
                y = fp8._Fp8Linear.apply(xi, w, None, settings, casts, True, False, False, None)
                forward_only = sum(cast_of_w) if forward_only is None else forward_only  # the first forward's
                y.backward(gx)
                grads.append(xi.grad)
        return grads, w.main_grad.clone(), (forward_only, sum(cast_of_w))

    casts = fp8.WeightCasts()
    each, each_main, each_count = step(casts, held=False)
    once, once_main, once_count = step(casts, held=True)
    assert each_count == (1, 2 * len(xs)) and once_count == (1, 2)
    assert all(torch.equal(a, b) for a, b in zip(each, once)) and torch.equal(each_main, once_main)
    assert not casts.holds(w)

    # frozen (LoRA's base): cast once for the run, in and out of held steps, again once the weight is written
    w.requires_grad_(False)
    frozen = fp8.WeightCasts()
    counts = []
    for held in (True, False, True):
        counts.append(step(frozen, held)[2][1])
    assert counts == [2, 0, 0] and frozen.holds(w)
    before = step(frozen, True)[0]
    with torch.no_grad():
        w.mul_(2)
    after, _, (_, recast) = step(frozen, True)
    assert recast == 2 and _rel(after[0], 2 * before[0]) < 0.01


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_casts_written_into_the_trained_weights_train_what_held_casts_train(recipe):
    """``in_weights`` (fp32 main weights apart: the optimizer writes the 16-bit weights again): a step's casts of a
    trained weight take the weight's own bytes, both layouts from its first forward, and give every micro-batch
    the gradients held casts give; a pass that no update follows (an evaluation, a reference model's), a frozen
    weight (LoRA's base) and one whose bytes are not two per element keep theirs apart."""
    fp8 = _fp8()
    settings = fp8.Fp8Training(format="hybrid", recipe=recipe)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(rows, 64, generator=gen).to(torch.bfloat16) for rows in (48, 37)]
    gs = [torch.randn(x.shape[0], 32, generator=gen).to(torch.bfloat16) for x in xs]
    master = (torch.randn(32, 64, generator=gen) * 0.1).to(torch.bfloat16)

    def step(w, in_weights: bool, updates: bool = True):
        casts = fp8.WeightCasts()
        casts.in_weights = in_weights
        if hasattr(w, "main_grad"):
            w.main_grad.zero_()
        grads, during = [], None
        with casts.holding(updates):
            for x, g in zip(xs, gs):
                xi = x.clone().requires_grad_()
                fp8._Fp8Linear.apply(xi, w, None, settings, casts, True, False, False, None).backward(g)
                grads.append(xi.grad)
                during = w.detach().clone() if during is None else during
        return grads, (w.main_grad.clone() if hasattr(w, "main_grad") else None), during

    w = torch.nn.Parameter(master.clone())
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(32, 64), False
    held, held_main, unchanged = step(w, in_weights=False)
    assert torch.equal(unchanged, master)
    lent, lent_main, during = step(w, in_weights=True)
    assert all(torch.equal(a, b) for a, b in zip(held, lent)) and torch.equal(held_main, lent_main)
    rows = fp8._both_layouts(master, settings)[0]
    assert torch.equal(during.view(-1).view(rows.data.dtype)[: w.numel()].view(w.shape), rows.data)
    w.data.copy_(master)  # what the optimizer step writes
    assert all(torch.equal(a, b) for a, b in zip(held, step(w, in_weights=True)[0]))
    w.data.copy_(master)
    evaluated = step(w, in_weights=True, updates=False)
    assert all(torch.equal(a, b) for a, b in zip(held, evaluated[0])) and torch.equal(evaluated[2], master)
    assert torch.equal(w, master)

    frozen = torch.nn.Parameter(master.clone(), requires_grad=False)
    assert all(torch.equal(a, b) for a, b in zip(held, step(frozen, in_weights=True)[0]))
    assert torch.equal(frozen, master)
    wide = torch.nn.Parameter(master.float())
    wide.main_grad, wide.grad_added_to_main_grad = torch.zeros(32, 64), False
    step(wide, in_weights=True)
    assert torch.equal(wide, master.float())


def test_unaligned_features_run_the_bf16_function():
    fp8 = _fp8()
    calls = []

    def bf16(**kwargs):
        calls.append(kwargs["weight"].shape)
        return kwargs["input"] @ kwargs["weight"].t()

    impl = fp8.Fp8ForwardImpl(bf16, fp8.Fp8Training(), fp8.WeightCasts())
    impl(torch.randn(5, 2, 64), torch.nn.Parameter(torch.randn(40, 64)), None, False, False, False)  # 40 outputs
    assert calls == [torch.Size([40, 64])]
    y = impl(torch.randn(5, 2, 64), torch.nn.Parameter(torch.randn(32, 64)), None, False, False, False)  # 10 tokens
    assert len(calls) == 1 and y.shape == (5, 2, 32)


def test_experts_run_fp8_only_where_torchs_grouped_kernel_beats_bf16():
    """torch's grouped FP8 GEMM on Hopper ran Qwen3-30B-A3B's experts (2048 -> 2 x 768 -> 2048) 1.4-1.7x as fast as
    bf16 at 128 rows per expert, at half the speed from 256 to 1024 and about even at 2048; Qwen3-235B-A22B's fc1
    (4096 -> 3072) 1.3-1.9x at every count (``benchmarks/results/h100_fp8/experts``). Where it loses each GEMM
    stays bf16, exactly bf16's result, while the other GEMM of the same call, narrow enough for the quick kernel, runs
    FP8; the planner counts the casts of the FP8 ones only."""
    from transformers import Qwen3MoeConfig

    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.models.native.experts import _Fp8GroupedMM
    from llamafactory_mca.parallel import ParallelLayout
    from llamafactory_mca.planner import memory

    fp8 = _fp8()
    gemms = ((2048, 1536), (1536, 2048), (768, 2048), (2048, 768))  # fc1's forward and input gradient, fc2's
    assert all(fp8.grouped_pays(128, k, n) for k, n in gemms)
    assert not any(fp8.grouped_pays(rows, k, n) for rows in (256, 512, 1024, 2048) for k, n in gemms)
    assert all(fp8.grouped_pays(rows, 4096, 3072) for rows in (128, 256, 2048))  # Qwen3-235B-A22B's fc1
    assert fp8.grouped_pays(128, 1536, 4096) and not fp8.grouped_pays(512, 1536, 4096)  # and its fc2

    gen = torch.Generator().manual_seed(0)
    shape = torch.Size([2, 32, 256])  # 256 rows for each of 2 experts: the forward (n 256) bf16, the input gradient
    param = (torch.randn(shape.numel(), generator=gen) / 8).to(torch.bfloat16).requires_grad_()  # (n 32) FP8
    x = torch.randn(512, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(512, 256, generator=gen).to(torch.bfloat16)
    offs = torch.tensor([256, 512], dtype=torch.int32)
    y = _Fp8GroupedMM.apply(x, param, offs, shape, False, fp8.WeightCasts())
    y.backward(grad)
    assert torch.equal(y, torch._grouped_mm(x.detach(), param.detach().view(shape), offs=offs))
    exact = torch._grouped_mm(grad, param.detach().view(shape).transpose(-2, -1), offs=offs)
    assert not torch.equal(x.grad, exact) and _rel(x.grad, exact) < 0.05

    moe = get_family("qwen3_moe").config_from_hf(Qwen3MoeConfig(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=1000))
    shapes, one = memory._shapes(moe), ParallelLayout(world_size=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=1,
                                                      expert_dp=1, micro_batch_size=1, grad_accum=1)
    expert = 128 * 3 * 2048 * 768
    for forward in (True, False):  # 128 rows each: every GEMM in FP8, one layout each way; 256: all bf16
        assert memory._expert_casts(shapes, 2048, one, forward) == expert
        assert memory._expert_casts(shapes, 4096, one, forward) == 0


def test_recipe_keys_become_one_decision():
    fp8 = _fp8()
    from llamafactory_mca.models import spec

    kwargs = {"fp8": "hybrid", "fp8_recipe": "rowwise", "num_layers_at_end_in_bf16": 2, "num_layers": 8}
    spec.prepare_config(kwargs)
    assert kwargs == {"num_layers": 8, "fp8_training": fp8.Fp8Training("hybrid", "rowwise", True, 1, 2)}
    settings = fp8.from_fields({"fp8": "e4m3", "first_last_layers_bf16": False, "fp8_wgrad": False})
    assert settings == fp8.Fp8Training("e4m3", "tensorwise", False, 0, 0)
    delayed = fp8.from_fields({"fp8": "e4m3", "fp8_recipe": "delayed", "fp8_amax_history_len": 16,
                               "fp8_amax_compute_algo": "max", "fp8_margin": 1})
    assert (delayed.delayed, delayed.amax_history, delayed.amax_algo, delayed.margin) == (True, 16, "max", 1)
    assert "largest maximum of 16 steps before" in delayed.describe(36, experts=False, hidden=4096)
    assert [n for n in range(1, 9) if fp8.Fp8Training().covers(n, 8)] == list(range(2, 8))
    line = fp8.Fp8Training("hybrid").describe(36, experts=False, hidden=4096)
    assert "layers 2-35 of 36" in line and "E5M2" in line and "router" in line and "experts" not in line
    assert "no gain" not in line
    moe = fp8.Fp8Training().describe(48, experts=True, hidden=2048)
    assert "_scaled_grouped_mm" in moe and "at hidden size 2048 expect no gain" in moe
    with pytest.raises(ValueError, match="fp8"):  # a built config would reach Megatron's TE path
        from megatron.core.transformer import TransformerConfig

        spec.prepare_config(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, fp8="e4m3"))


# ----------------------------------------------------------------------------- TP2 + SP, a model of four layers


def _tp_run(tp: int) -> dict:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from llamafactory_mca import parallel
    from llamafactory_mca.models import spec
    from tests.models.test_native_spec import _config, _forward, _inputs, _layout, _model

    fp8 = _fp8()
    parallel.initialize(_layout(world=tp, tp=tp), seed=11)
    out = {}
    for name, settings in (("bf16", None), ("tensorwise", fp8.Fp8Training()),
                           ("rowwise", fp8.Fp8Training("hybrid", "rowwise")), ("delayed", fp8.Fp8Training("e4m3",
                                                                                                       "delayed"))):
        config = dataclasses.replace(_config(tp=tp, sp=tp > 1), num_layers=4, bf16=True, params_dtype=torch.bfloat16)
        torch.manual_seed(5)
        model = _model(config, block=True).to(torch.bfloat16)
        casts = None
        if settings is not None:
            config.fp8_training = settings
            casts = fp8.use_fp8([model], settings, config.num_layers)
            out[f"{name}_routed"] = casts.routed
            out[f"{name}_summary"] = spec.describe_kernels(config)
            kinds = [type(m._forward_impl).__name__ for layer in model.decoder.layers for m in layer.modules()
                     if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
            out[f"{name}_kinds"] = kinds
            model.decoder.layers[1].mlp.linear_fc1.weight.requires_grad_(False)  # a frozen base (LoRA's)
        tokens, _, weights, _ = _inputs()
        if name == "delayed":  # a first step records the maxima the measured step is scaled by
            with casts.holding():
                (gather_from_tensor_model_parallel_region(_forward(model, tokens)).float() * weights).sum().backward()
            model.zero_grad(set_to_none=True)
            out["delayed_primed"] = casts.scales.primed and bool((casts.scales.used > 0).all())
        passes = []  # FP8: a second micro-batch of the step on the first's weight casts (held, as the trainer holds)
        with casts.holding() if casts is not None else contextlib.nullcontext():
            for _ in range(1 if casts is None else 2):
                logits = gather_from_tensor_model_parallel_region(_forward(model, tokens))
                (logits.float() * weights).sum().backward()
                passes.append(logits.detach().float())
        # the gradients of identical passes add up exactly: halved, one pass's
        fc2 = model.decoder.layers[2].mlp.linear_fc2.weight.grad / len(passes)  # row parallel: [hidden, ffn / tp]
        out[name] = {"logits": passes[0], "fc2": fc2.float(),
                     "embedding": model.embedding.word_embeddings.weight.grad.float() / len(passes),
                     "held_equal": all(torch.equal(p, passes[0]) for p in passes)}
    if tp == 1:
        out["experts"] = _experts()
    return out


def _experts() -> dict:
    """Grouped experts with FP8 forward and input gradient against the same experts in bf16 (an expert without
    tokens among them), the weight gradient into main_grad in both."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from llamafactory_mca.models.native.experts import NativeGroupedMLP
    from tests.models.test_native_spec import _config

    fp8 = _fp8()
    config = dataclasses.replace(_config(moe=True), moe_ffn_hidden_size=48, bf16=True, params_dtype=torch.bfloat16,
                                 gradient_accumulation_fusion=True)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    counts = torch.tensor([13, 0, 30, 16])  # 59 rows: padded to 64 for the GEMMs
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(59, 64, generator=gen).to(torch.bfloat16)
    probs, grad = torch.rand(59, generator=gen), torch.randn(59, 64, generator=gen).to(torch.bfloat16)
    found = {}
    for name, settings in (("bf16", None), ("fp8", fp8.Fp8Training()), ("held", fp8.Fp8Training())):
        torch.manual_seed(0)
        experts = NativeGroupedMLP(4, config, pg_collection=pgs).to(torch.bfloat16)
        experts.fp8, experts.fp8_casts = settings, fp8.WeightCasts()
        for p in experts.parameters():
            p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape), False
        with experts.fp8_casts.holding() if name == "held" else contextlib.nullcontext():
            for _ in range(2 if name == "held" else 1):  # the second micro-batch reads the first's casts
                xi = x.clone().requires_grad_()
                y, _ = experts(xi, counts, probs.clone())
                y.backward(grad)
        found[name] = (y.detach(), xi.grad, experts.weight1.main_grad.clone(), experts.weight2.main_grad.clone())
    rel = {k: _rel(a, b) for k, a, b in zip(("out", "dx", "dw1", "dw2"), found["fp8"], found["bf16"])}
    rel["held_equal"] = all(torch.equal(a, b) for a, b in zip(found["held"][:2], found["fp8"][:2]))
    return rel


@pytest.fixture(scope="module")
def one_rank():
    return run_distributed(_tp_run, 1, 1)[0]


def test_grouped_experts_in_fp8_near_bf16(one_rank):
    rel = dict(one_rank["experts"])
    assert rel.pop("held_equal")  # a step's second micro-batch on the first's weight casts: the same output
    # two FP8 GEMMs in a row (fc1, fc2), each ~3.5% off in E4M3 on Gaussian data
    assert all(value < 0.09 for value in rel.values()), rel


def test_fp8_model_near_bf16_and_tp2_sequence_parallel_equal_one_rank(one_rank):
    per_rank = run_distributed(_tp_run, 2, 2)
    for recipe in ("tensorwise", "rowwise"):
        assert one_rank[f"{recipe}_routed"] == 8  # layers 2 and 3 of 4: qkv, proj, fc1, fc2 each
        kinds = one_rank[f"{recipe}_kinds"]
        assert len(kinds) == 16 and kinds.count("Fp8ForwardImpl") == 8, kinds
        assert "FP8" in one_rank[f"{recipe}_summary"] and "layers 2-3 of 4" in one_rank[f"{recipe}_summary"]
        mine, bf16 = one_rank[recipe], one_rank["bf16"]
        assert mine["held_equal"], recipe  # the second micro-batch on held weight casts computed the first's logits
        assert _rel(mine["logits"], bf16["logits"]) < 0.05, recipe
        assert _rel(mine["embedding"], bf16["embedding"]) < 0.1, recipe  # through all four layers' backward
        assert _rel(mine["fc2"], bf16["fc2"]) < 0.1, recipe
        for rank, out in enumerate(per_rank):  # each rank scales its own shards: as near bf16 as one rank is
            assert out[f"{recipe}_routed"] == 8 and out[recipe]["held_equal"], (recipe, rank)
            half = bf16["fc2"].shape[1] // 2
            assert _rel(out[recipe]["logits"], bf16["logits"]) < 0.05, (recipe, rank)
            assert _rel(out[recipe]["fc2"], bf16["fc2"][:, rank * half:(rank + 1) * half]) < 0.1, (recipe, rank)
            rows = bf16["embedding"].shape[0] // 2  # the input gradients' reduce-scatter reaches the embedding
            assert _rel(out[recipe]["embedding"], bf16["embedding"][rank * rows:(rank + 1) * rows]) < 0.1
            assert _rel(out["bf16"]["logits"], bf16["logits"]) < 0.01, rank
    # delayed scaling, its second step on the same data scaled by the first's maxima: tensorwise's numbers exactly
    for out in (one_rank, *per_rank):
        assert out["delayed_primed"] and out["delayed_routed"] == 8
        assert all(torch.equal(out["delayed"][k], out["tensorwise"][k]) for k in ("logits", "fc2", "embedding"))
        assert "delayed (activations and gradients scaled by the last maximum of 1 step before" in \
            out["delayed_summary"]


def test_delayed_scales_come_from_the_steps_before():
    """The first step scales each tensor by its own maximum and records it; later steps by the record (a larger
    value saturates at it); a place that saw nothing (or only zeros) keeps its scale; ``max`` over a history of
    two, and a margin."""
    fp8 = _fp8()
    e4m3, fmax = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max

    def inv(scales, x, place=0):
        return float(scales.cast(x.to(torch.bfloat16), e4m3, place, rows=True, cols=False)[0].scale_inv)

    x = torch.zeros(20, 16)
    scales = fp8.DelayedScales(fp8.Fp8Training(recipe="delayed"))
    assert scales.place(2) == 0 and scales.place(2) == 2
    assert inv(scales, x + 3) == pytest.approx(3 / fmax) and float(scales.seen[0].max()) == 3  # current, recorded
    inv(scales, x + 0.5, place=1)
    scales.roll()
    big = x.clone()
    big[0, 0] = 6
    op, _ = scales.cast(big.to(torch.bfloat16), e4m3, 0, rows=True, cols=False)
    assert float(op.scale_inv) == pytest.approx(3 / fmax) and float(op.data.float().max() * op.scale_inv) == 3
    assert float(scales.seen[0].max()) == 6 and float(scales.seen[1].max()) == 0
    inv(scales, x, place=1)  # all zeros
    scales.roll()
    assert scales.used.tolist()[:2] == [6, 0.5] and scales.used.tolist()[2:] == [0, 0]
    assert scales.unknown == {2, 3} and inv(scales, x + 5, place=2) == pytest.approx(5 / fmax)  # its own maximum
    history = fp8.DelayedScales(fp8.Fp8Training(recipe="delayed", amax_history=2, amax_algo="max", margin=1))
    history.place()
    for value in (3, 6, 1):
        inv(history, x + value)
        history.roll()
    assert float(history.used[0]) == 12  # max(6, 1) * 2^1
