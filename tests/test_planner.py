"""The planner: its arithmetic against numbers worked by hand, its search against the layout check the run makes,
and ``llamafactory-mca plan`` on a recipe as a user runs it."""

import dataclasses
import itertools
import json
import os
import sys

import pytest
import yaml
from transformers import Qwen3Config, Qwen3MoeConfig

from llamafactory_mca.errors import UserError
from llamafactory_mca.models.families import get_family
from llamafactory_mca.models.native.fp8 import Fp8Training
from llamafactory_mca.parallel import ParallelLayout, check_layout
from llamafactory_mca.planner import memory
from llamafactory_mca.planner.memory import Training, estimate
from llamafactory_mca.planner.search import predicted_tokens_per_s, search
from tests._cli import cli_env, fake_hub_cache, make_assets, one_error, recipe, run


GIB = 1024**3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from e2e_workloads import SHAPES, model_config  # noqa: E402  (the benchmarks' full-size shapes: real config.json values)


def _dense(**overrides):
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=False)
    return get_family("qwen3").config_from_hf(Qwen3Config(**{**shape, **overrides}))


def _layout(world=1, tp=1, pp=1, cp=1, ep=1, micro=1, accum=1):
    dp = world // (tp * pp * cp)
    return ParallelLayout(world_size=world, tp=tp, pp=pp, vpp=None, cp=cp, ep=ep, etp=1, dp=dp,
                          expert_dp=world // (ep * pp), micro_batch_size=micro, grad_accum=accum)


def test_breakdown_by_hand(monkeypatch):
    """h 64, 4 layers, q 64, kv 32, f 128, vocab 1000 untied, 100 tokens, one GPU: worked out term by term."""
    monkeypatch.setattr(memory, "ACTIVATION_FIT", 1.0)
    h, q, kv, f, vocab, tokens = 64, 64, 32, 128, 1000, 100
    layer = h * (q + 2 * kv) + q * h + 2 * 16 + 2 * h + 3 * h * f  # qkv, o, q/k norms (head_dim), 2 norms, SwiGLU
    params = 4 * layer + 2 * vocab * h + h  # + embedding, output layer, final norm
    got = estimate(_dense(), _layout(), Training(tokens=tokens))
    # the final norm and q/k norms are left out of the estimate's count: within 0.2% of the exact count
    assert got["weights"] == pytest.approx(params * 2 / GIB, rel=2e-3, abs=0.006)
    assert got["grads"] == pytest.approx(params * 4 / GIB, rel=2e-3, abs=0.006)
    assert got["optimizer"] == pytest.approx(params * 12 / GIB, rel=2e-3, abs=0.006)
    per_layer = 2 * tokens * (4 * h + (q + 2 * kv) + 2 * (q + kv) + 2 * q + 3 * f)
    assert got["activations"] == pytest.approx(4 * per_layer / GIB, abs=0.006)
    assert got["logits"] == pytest.approx(tokens * vocab * memory.LOGIT_BYTES / GIB, abs=0.006)
    # FP8 tensorwise (layers 2 and 3 of 4): QKV's and fc1's inputs and fc2's kept in one byte instead of two,
    # out-projection's beside the attention output; one linear's FP8 copies (fc1's dy both ways); the weights' casts
    # in the weights' own memory (fp32 main weights apart: the optimizer writes the weights again), else those of
    # the forward (a byte per weight element of layers 2 and 3: in a step of one micro-batch the input gradient's
    # come as the backward frees far more). A million tokens: the estimate is rounded to 0.01 GiB
    tokens = 2**20
    per_layer = 2 * tokens * (4 * h + (q + 2 * kv) + 2 * (q + kv) + 2 * q + 3 * f)
    change = -2 * tokens * h + tokens * q - tokens * f
    buffers = 2 * tokens * 2 * f
    fp8 = estimate(_dense(), _layout(), Training(tokens=tokens, fp8=Fp8Training()))
    assert fp8["activations"] == pytest.approx((4 * per_layer + 2 * change + buffers) / GIB, abs=0.006)
    for held in (dict(param_remainders=True), dict(cpu_offload=True)):
        held = estimate(_dense(), _layout(), Training(tokens=tokens, fp8=Fp8Training(), **held))
        assert held["activations"] == pytest.approx((4 * per_layer + 2 * change + buffers + 2 * layer) / GIB,
                                                    abs=0.006)
    rowwise = estimate(_dense(), _layout(), Training(tokens=tokens, fp8=Fp8Training(recipe="rowwise")))
    assert rowwise["activations"] == pytest.approx((4 * per_layer + buffers) / GIB, abs=0.006)
    assert fp8["activations"] < rowwise["activations"]
    # the weight casts alone (no tokens; q/k norms left out, as above): both layouts' bytes where the backward frees
    # no activations, the pipeline has begun it at the peak or a second micro-batch's forward follows; the
    # forward's where one micro-batch's backward frees more; none where CUDA graphs cast inside each replay; a frozen
    # base's both, kept for the run, graphed or not
    shapes, covered, dense = memory._shapes(_dense()), [False, True, True, False], [False] * 4
    weights = 2 * (layer - 2 * 16)
    cases = (([0.0] * 4, 1, 1, 2 * weights), ([weights] * 4, 1, 1, weights), ([weights] * 4, 2, 2, 2 * weights),
             ([weights] * 4, 1, 8, 2 * weights))  # (kept, in flight, micro-batches, held)
    for kept, in_flight, micro_batches, held in cases:
        for in_weights in (False, True):
            assert memory._fp8_buffers(shapes, 0, _layout(), covered, dense, False, kept, in_flight, micro_batches,
                                       False, in_weights) == (0 if in_weights else held)
    assert memory._fp8_buffers(shapes, 0, _layout(), covered, dense, True, [0.0] * 4, 1, 1, False, False) == 0
    for graphs, in_weights in itertools.product((False, True), (False, True)):
        assert memory._fp8_buffers(shapes, 0, _layout(), covered, dense, graphs, [weights] * 4, 1, 1,
                                   True, in_weights) == 2 * weights


def test_layouts_divide_what_they_should():
    """DP shards the optimizer, TP everything, PP the layers (the first stage keeps pp micro-batches in flight),
    full recompute keeps one input per layer, LoRA keeps no gradient or optimizer state for the frozen base."""
    config, shaped = _dense(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, vocab_size=32000), \
        Training(tokens=4096)
    one = estimate(config, _layout(), shaped)
    dp2 = estimate(config, _layout(world=2), shaped)
    assert dp2["optimizer"] == pytest.approx(one["optimizer"] / 2, rel=0.05)
    assert dp2["weights"] == one["weights"] and dp2["activations"] == one["activations"]
    tp2 = estimate(config, _layout(world=2, tp=2), Training(tokens=4096, sequence_parallel=True))
    assert tp2["weights"] == pytest.approx(one["weights"] / 2, rel=0.05)
    assert tp2["activations"] == pytest.approx(one["activations"] / 2, rel=0.05)
    pp2 = estimate(config, _layout(world=2, pp=2, accum=8), shaped)
    # the worst stage: the first (half the layers, two micro-batches in flight: all of one GPU's activations) or
    # the last (half the layers, one in flight, and the logits with the output layer)
    assert pp2["activations"] in (pytest.approx(one["activations"], rel=0.05),
                                  pytest.approx(one["activations"] / 2, rel=0.05))
    assert pp2["peak"] < one["peak"] and pp2["weights"] < one["weights"]
    full = estimate(config, _layout(), Training(tokens=4096, recompute="full"))
    assert full["activations"] < one["activations"] / 3
    selective = estimate(config, _layout(), Training(tokens=4096, recompute="selective",
                                                     recompute_modules=("core_attn", "mlp")))
    assert full["activations"] < selective["activations"] < one["activations"]
    lora = estimate(config, _layout(), Training(tokens=4096, lora_rank=8))
    assert lora["weights"] == one["weights"] and lora["optimizer"] < one["optimizer"] / 50
    remainders = estimate(config, _layout(), Training(tokens=4096, param_remainders=True))  # the main copy's low half
    assert remainders["optimizer"] == pytest.approx(one["optimizer"] * 10 / 12, rel=0.01)
    assert remainders["weights"] == one["weights"] and remainders["grads"] == one["grads"]


def test_search_proposes_only_layouts_the_run_accepts():
    """4 heads and 2 KV groups: TP 4 and 8 are refused by the layout check; every proposal passes it, keeps the
    global batch, and fits."""
    config = _dense(vocab_size=1024)
    found, refused = search(config, 8, 16, Training(tokens=256), gpu_memory_gib=80.0, peak_flops=989e12)
    assert found and refused
    for candidate in found:
        layout = candidate.layout
        check_layout(config, layout, False, layout.tp > 1)
        assert layout.dp * layout.micro_batch_size * layout.grad_accum == 16
        assert candidate.memory["needs"] <= 80.0 and layout.tp <= 2
    speeds = [round(c.tokens_per_s) for c in found]
    assert speeds == sorted(speeds, reverse=True)
    with pytest.raises(UserError):
        check_layout(config, _layout(world=8, tp=4), False, True)


def test_search_walks_virtual_pipelines_and_expert_tensor_parallelism():
    """An MoE model on 8 GPUs: the search also proposes VPP and ETP layouts, each one the run's check accepts and
    pasted with its keys; a recipe asking for CUDA graphs gets `cuda_graphs: false` where the layout cannot run
    them (pipeline stages, context parallelism, experts split over GPUs, full recompute)."""
    hf = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024, num_experts=16,
                        num_experts_per_tok=4)
    config = get_family("qwen3_moe").config_from_hf(hf)
    found, _ = search(config, 8, 16, Training(tokens=256, cuda_graphs=True), gpu_memory_gib=80.0, peak_flops=989e12)
    for candidate in found:
        layout = candidate.layout
        check_layout(config, layout, False, layout.tp > 1)
        graphs = layout.pp == layout.cp == layout.ep == layout.etp == 1 and candidate.recompute is None
        assert candidate.keys.get("cuda_graphs", True) is graphs, candidate
    assert any(c.keys.get("virtual_pipeline_model_parallel_size") == 2 for c in found)
    assert any(c.keys.get("expert_tensor_parallel_size") == 2 for c in found)


def test_search_keeps_a_vision_language_model_to_the_layouts_it_runs():
    """Qwen3-VL (deepstack features into the first decoder layers) on 8 GPUs: no context parallelism, and no stage
    split that puts the deepstack layers past the tower's stage: what the run's plan refuses."""
    from llamafactory_mca.models.multimodal import check_vision_layout
    from llamafactory_mca.tools.tiny import tiny_hf_config

    config = get_family("qwen3_vl").config_from_hf(tiny_hf_config("qwen3_vl"))
    found, refused = search(config, 8, 16, Training(tokens=256), gpu_memory_gib=80.0, peak_flops=989e12)
    assert found and any("vision-language" in reason for reason in refused)
    for candidate in found:
        check_vision_layout(config, candidate.layout)
        assert candidate.layout.cp == 1


def test_small_gemma4_is_counted_whole_and_kept_to_the_layouts_it_runs():
    """Gemma 4 E2B's shape (35 layers of 1536; per-layer inputs of 256 per layer, a second embedding of 262,144 x
    8,960; the last 20 layers attending with earlier layers' keys and values, their MLP twice as wide): the model's
    parameter count is transformers' own, the planner's weights are it, and TP leaves the second embedding whole on
    every rank. The search proposes neither pipelining nor full recompute, which the run refuses for it."""
    import torch
    from transformers import AutoConfig as HfAutoConfig
    from transformers import AutoModelForCausalLM

    from llamafactory_mca.models.cost import model_parameter_count, small_gemma4_weights

    shape = model_config("gemma4_e2b", 35, False)
    hf = HfAutoConfig.for_model(**shape)
    config = get_family("gemma4_text").config_from_hf(hf)
    with torch.device("meta"):
        count = AutoModelForCausalLM.from_config(hf).num_parameters()
    assert model_parameter_count(config) == count and 4.6e9 < count < 4.7e9
    got = estimate(config, _layout(), Training(tokens=4096))
    assert got["weights"] == pytest.approx(count * 2 / GIB, rel=1e-3)
    # two key/value heads (E2B has one): TP2 splits all but the replicated part
    two = get_family("gemma4_text").config_from_hf(HfAutoConfig.for_model(**{**shape, "num_key_value_heads": 2}))
    replicated, _ = small_gemma4_weights(two.transformer)
    assert replicated > 2.3e9  # the second embedding
    halves = estimate(two, _layout(world=2, tp=2), Training(tokens=4096))["weights"]
    assert halves == pytest.approx((model_parameter_count(two) - replicated) / 2 * 2 / GIB + replicated * 2 / GIB,
                                   rel=2e-3)
    found, refused = search(config, 8, 16, Training(tokens=4096), gpu_memory_gib=80.0, peak_flops=989e12)
    assert found and any("per-layer inputs and shared keys and values" in reason for reason in refused)
    for candidate in found:
        check_layout(config, candidate.layout, False, candidate.layout.tp > 1)
        assert candidate.layout.pp == 1 and candidate.recompute is None


def test_moe_experts_split_by_expert_parallelism():
    hf = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000, num_experts=64,
                        num_experts_per_tok=4)
    config = get_family("qwen3_moe").config_from_hf(hf)
    one = estimate(config, _layout(world=2), Training(tokens=512))
    ep2 = estimate(config, _layout(world=2, ep=2), Training(tokens=512))
    experts = 4 * 64 * 3 * 256 * 256  # layers x experts x SwiGLU's three matrices
    assert one["weights"] - ep2["weights"] == pytest.approx(experts / 2 * 2 / GIB, abs=0.011)


def test_micro_batches_merge_where_the_experts_gain_and_memory_allows():
    """``merge_micro_batches: auto`` on Qwen3-30B-A3B's shape (8 layers, 4,096-token packs: 256 rows per expert) merges
    two packs into one micro-batch on a 141 GB GPU (512 rows), LoRA's frozen experts too, not where the estimate does
    not fit, and never for unpacked rows, preference pairs, pipeline stages, graphs or without a GPU; a dense model
    only while its micro-batch is narrow work (tokens x hidden up to 4,096 x 4,096, where its layers wait on the
    host), LoRA or not; an explicit factor that cannot apply is one clear error."""
    from transformers import Qwen3MoeConfig

    from llamafactory_mca.planner.micro_batches import plan_merge

    shape = {k: v for k, v in SHAPES["moe"].items() if k != "model_type"}
    moe = get_family("qwen3_moe").config_from_hf(Qwen3MoeConfig(**{**shape, "num_hidden_layers": 8}))
    packs = Training(tokens=4096)

    def factor(request="auto", config=moe, layout=None, training=packs, stage="sft", packing=True, graphs=False,
               gib=140.0):
        return plan_merge(request, config, layout or _layout(accum=8), training, stage, packing, graphs,
                          lambda: gib).factor

    assert factor() == 2
    assert factor(gib=115) == 1  # two packs' activations do not fit beside the weights and Adam states
    assert factor(training=Training(tokens=1024)) == 8  # 64 rows per expert: merged up to 512
    assert factor(layout=_layout(accum=6), training=Training(tokens=1024)) == 2  # 4 and 8 do not divide 6
    assert factor(layout=_layout(world=2, ep=2, accum=8)) == 1  # EP2 gathers 512 rows already
    assert [factor(packing=False), factor(stage="dpo"), factor(layout=_layout(accum=7)),
            factor(layout=_layout(world=2, pp=2, accum=8)), factor(graphs=True), factor(gib=None),
            factor(request=1)] == [1] * 7
    assert factor(training=Training(tokens=4096, lora_rank=8)) == 2  # no weight gradients, but rows and launches
    narrow = dict(hidden_size=1536, intermediate_size=6144, num_attention_heads=8, head_dim=256)
    assert factor(config=_dense(**narrow)) == 2  # 8,192 tokens of 1536: up to 4,096 x 4,096, not past it
    assert factor(config=_dense(**narrow), training=Training(tokens=4096, lora_rank=8)) == 2
    assert factor(config=_dense(**narrow), training=Training(tokens=1024)) == 8
    assert factor(config=_dense(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, head_dim=128)) == 1
    assert factor(request=4, config=_dense()) == 4
    assert factor(request=2, graphs=True) == 2  # graphs capture the merged packs
    for request, kwargs, message in ((3, {}, "gradient_accumulation_steps=8 is not a multiple of it"),
                                     (2, {"stage": "dpo"}, "stage dpo keeps its rows' pairs"),
                                     (2, {"packing": False}, "the rows are not packed")):
        with pytest.raises(UserError, match=message):
            factor(request=request, **kwargs)


def test_what_would_fit_names_the_cheapest_changes_that_go_together():
    """A MoE recipe over its GPU: the remainders, then bf16 moments beside them (no speed lost), then recompute on
    top; the CPU-offloaded optimizer and LoRA keep fp32 states, so a suggestion with them never names the
    remainders or the moments; each suggestion's estimate fits."""
    from llamafactory_mca.planner.advice import cheapest_changes

    shape = {k: v for k, v in SHAPES["moe"].items() if k != "model_type"}
    moe = get_family("qwen3_moe").config_from_hf(Qwen3MoeConfig(**{**shape, "num_hidden_layers": 8}))
    layout, packs = _layout(accum=8), Training(tokens=4096)
    saving = "store_param_remainders: true, exp_avg_dtype: bf16, exp_avg_sq_dtype: bf16"
    saved = estimate(moe, layout, dataclasses.replace(packs, param_remainders=True, moment_bytes=4))["optimizer"]
    assert saved == pytest.approx(estimate(moe, layout, packs)["optimizer"] / 2, rel=1e-3)  # 2 + 4 bytes, not 4 + 8
    suggested = {}
    for budget in (100, 90, 72, 40):
        first = cheapest_changes(moe, layout, packs, budget, 989e12)[0]
        keys, needs = first.rsplit(" (", 1)
        assert float(needs.split()[0]) <= budget
        suggested[budget] = keys
    assert suggested == {100: "store_param_remainders: true", 90: saving,
                         72: f"{saving} + recompute_granularity: full",
                         40: "recompute_granularity: full + optimizer_cpu_offload: true"}


def test_vision_tower_counted_by_its_own_class():
    """A VL model's first stage holds the tower's bf16 weights (every parameter of transformers' own tower); frozen
    (LLaMA-Factory's default) it adds nothing else, trained it adds its gradients, Adam states and activations."""
    import torch

    from llamafactory_mca.models.multimodal import build_vision_tower
    from llamafactory_mca.tools.tiny import tiny_hf_config

    hf = tiny_hf_config("qwen2_5_vl")
    config = get_family("qwen2_5_vl").config_from_hf(hf)
    tower = build_vision_tower(config.hf_config, torch.float32)
    params = sum(p.numel() for p in tower.parameters())
    text = dataclasses.replace(config, hf_config={k: v for k, v in config.hf_config.items() if k != "vision_config"})
    frozen, bare = (estimate(c, _layout(), Training(tokens=256)) for c in (config, text))
    assert frozen["weights"] - bare["weights"] == pytest.approx(params * 2 / GIB, abs=0.006)
    assert (frozen["grads"], frozen["optimizer"], frozen["activations"]) == \
        (bare["grads"], bare["optimizer"], bare["activations"])
    trained = estimate(config, _layout(), Training(tokens=256, freeze_vision_tower=False, freeze_projector=False))
    assert trained["grads"] - bare["grads"] == pytest.approx(params * 4 / GIB, abs=0.006)
    long = Training(tokens=1 << 20)  # enough patches for the tiny tower's activations to show in GiB
    assert estimate(config, _layout(), dataclasses.replace(long, freeze_vision_tower=False))["activations"] > \
        estimate(text, _layout(), long)["activations"] == estimate(config, _layout(), long)["activations"]
    assert memory.vision_tower(config, Training(tokens=256, freeze_projector=False)).trainable == \
        sum(p.numel() for n, p in tower.named_parameters() if n.startswith("merger."))


def test_internvl_over_gpt_oss_is_counted_whole_and_spreads_its_experts():
    """InternVL3.5-GPT-OSS-20B-A4B's shape (gpt-oss-20b's decoder, the benchmarks', under InternViT-300M: 24 blocks
    of 1024, 448-pixel tiles folded into 256 tokens): the planner's weights are transformers' whole model (tower,
    projector, sinks, biased experts), EP8 holds 1/8 of the experts, and the search proposes expert parallelism but
    neither context parallelism (a VL model) nor splitting the biased experts (ETP)."""
    import torch
    from transformers import AutoConfig as HfAutoConfig
    from transformers import AutoModelForImageTextToText

    from llamafactory_mca.models.multimodal import check_vision_layout

    text = dict(SHAPES["gpt_oss"], layer_types=["sliding_attention", "full_attention"] * 12)
    hf = HfAutoConfig.for_model("internvl", text_config=text, image_seq_length=256, downsample_ratio=0.5,
                                tie_word_embeddings=False, vision_config=SHAPES["internvl"]["vision_config"])
    config = get_family(hf).config_from_hf(hf)
    with torch.device("meta"):
        count = AutoModelForImageTextToText.from_config(hf).num_parameters()
    one = estimate(config, _layout(), Training(tokens=4096))
    assert one["weights"] == pytest.approx(count * 2 / GIB, rel=1e-3) and 21.2e9 < count < 21.3e9
    experts = 24 * 32 * (2880 * 2 * 2880 + 2 * 2880 + 2880 * 2880 + 2880)  # gate_up and down, with their biases
    ep8 = estimate(config, _layout(world=8, ep=8), Training(tokens=4096))
    assert one["weights"] - ep8["weights"] == pytest.approx(experts * 7 / 8 * 2 / GIB, abs=0.011)
    found, refused = search(config, 8, 16, Training(tokens=4096), gpu_memory_gib=80.0, peak_flops=989e12)
    assert any(c.layout.ep > 1 for c in found) and any("vision-language" in reason for reason in refused)
    for candidate in found:
        check_vision_layout(config, candidate.layout)
        assert candidate.layout.cp == candidate.layout.etp == 1


def test_speed_model_follows_the_work():
    """The predicted tokens/s: graphed dense layers lose the host's launch time, LoRA's frozen base skips the weight
    gradients, full recompute adds a forward (selective: core attention's), longer micro-batches spread the host's
    time, and the layout shares cut a GPU's rate."""
    config = _dense(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936)
    rate = lambda layout=_layout(), **keys: predicted_tokens_per_s(  # noqa: E731
        config, layout, Training(tokens=4096, **keys), 989e12)
    eager = rate()
    assert 20e3 < eager < 35e3  # the dense benchmark measured 25.5-31.5k tokens/s eager on one H200
    assert rate(cuda_graphs=True) > 1.2 * eager and rate(lora_rank=16) > 1.3 * eager
    assert rate(recompute="full") < 0.8 * eager < rate(_layout(micro=2))
    assert rate(_layout(world=2, tp=2)) < 0.5 * eager and rate(_layout(world=2)) < eager
    # selective recompute of core attention adds one forward of QK^T and AV: little at 4k, a sixth of the step at 32k
    long = lambda **keys: predicted_tokens_per_s(config, _layout(), Training(tokens=32768, **keys), 989e12)  # noqa: E731
    assert 0.97 * eager < rate(recompute="selective") < eager
    assert long(recompute="full") < long(recompute="selective") < 0.9 * long()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("planner"))


def test_plan_command(tmp_path, assets):
    """The recipe's own layout, then a search on 4 GPUs of 16 GiB; --json's last line is the whole answer."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(assets, tmp_path / "out", pipeline_model_parallel_size=2)))
    result, output = run(["llamafactory-mca", "plan", str(path), "cutoff_len=128", "--gpus", "4", "--gpu-memory",
                          "16", "--json"], alone=False)
    assert result.returncode == 0, output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["fits"] is True and answer["tokens_per_row"] == 128
    assert answer["peak_gib"] == pytest.approx(sum(answer["breakdown"].values()), abs=0.05)
    assert "pp=2" in answer["layout"] and answer["layouts"]
    assert all(row["needs_gib"] <= 16 for row in answer["layouts"])
    assert "per GPU (the largest pipeline stage)" in result.stdout
    assert not (tmp_path / "out").exists()  # a plan writes nothing


def test_plan_bad_input(tmp_path, assets):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(assets, tmp_path / "out", tensor_model_parallel_size=3)))
    result, output = run(["llamafactory-mca", "plan", str(path), "--gpus", "3", "--gpu-memory", "16"], alone=False)
    one_error(result, output, "tensor_model_parallel_size=3")
    result, output = run(["llamafactory-mca", "plan", str(path), "--gpus", "0"], alone=False)
    one_error(result, output, "--gpus 0")
    # GLM-5's sparse attention and Megatron's selective recompute of core attention, which drops the indexer's inputs
    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model("glm_moe_dsa", str(tmp_path / "glm5"), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    path.write_text(yaml.safe_dump(recipe(assets, tmp_path / "out", model_name_or_path=model,
                                          recompute_granularity="selective")))
    result, output = run(["llamafactory-mca", "plan", str(path), "--gpus", "1", "--gpu-memory", "16"], alone=False)
    one_error(result, output, "glm_moe_dsa: recompute_modules=['core_attn'] with recompute_granularity=selective",
              "recompute_granularity: full")
    # Gemma 4 E2B's layers attending with earlier layers' keys and values, and full recompute
    model = save_tiny_model("gemma4_text_e2b", str(tmp_path / "e2b"), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    path.write_text(yaml.safe_dump(recipe(assets, tmp_path / "out", model_name_or_path=model,
                                          recompute_granularity="full")))
    result, output = run(["llamafactory-mca", "plan", str(path), "--gpus", "1", "--gpu-memory", "16"], alone=False)
    one_error(result, output, "gemma4_text: recompute_granularity=full with layers that attend with an earlier "
              "layer's keys and values", "recompute_granularity: selective")


# Qwen/Qwen2-VL-7B-Instruct's config.json: Qwen2.5-VL-7B's language model (the benchmarks' shape) with a shorter
# context, under Qwen2-VL's own tower
QWEN2_VL_7B = dict(SHAPES["vl"], model_type="qwen2_vl",
                   text_config={**SHAPES["vl"]["text_config"], "max_position_embeddings": 32768},
                   vision_config=dict(depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4, num_heads=16,
                                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2))
# InternVL3.5-38B-HF: Qwen3-32B's decoder and the InternViT-6B encoder (45 blocks of 3200, q/k norms, RMSNorm),
# 448-pixel tiles of 14-pixel patches folded 2 x 2 into 256 tokens
INTERNVL3_5_38B = dict(
    model_type="internvl", image_seq_length=256, downsample_ratio=0.5, image_token_id=151671,
    tie_word_embeddings=False,
    text_config=dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                     num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    vision_config=dict(hidden_size=3200, intermediate_size=12800, num_hidden_layers=45, num_attention_heads=25,
                       use_qk_norm=True, norm_type="rms_norm", image_size=[448, 448], patch_size=[14, 14]))
# The recipes with the hardware their header names (GPUs, GiB), each planned on its model's full-size config: the
# benchmarks' shapes, or the one above. Not here: qwen3_5_full.yaml (no config of Qwen3.5-27B's size is at hand).
RECIPES = {"qwen3_dense_sft.yaml": ("dense", 1, 80), "qwen3_long_context_cp2.yaml": ("dense", 2, 80),
           "qwen3_dpo.yaml": ("dense", 1, 80),
           "qwen3_moe_full.yaml": ("moe", 8, 80), "qwen3_moe_lora.yaml": ("moe", 1, 141),
           "glm4_5_air_lora.yaml": ("glm", 8, 80), "moonlight_full.yaml": ("moonlight", 8, 80),
           "qwen3_next_full.yaml": ("next", 8, 80), "qwen2_vl_full.yaml": (QWEN2_VL_7B, 8, 80),
           "qwen3_vl_moe_full.yaml": ("vl_moe", 8, 80), "qwen3_5_moe_full.yaml": ("vl_next", 8, 80),
           "glm4_5v_lora.yaml": ("glm_vl", 8, 80), "gemma3_27b_full.yaml": ("gemma_vl", 8, 80),
           "internvl3_5_38b_lora.yaml": (INTERNVL3_5_38B, 8, 80), "glm5_lora.yaml": ("glm5", 16, 141)}


# Plans each recipe given on the command line (a JSON list of the plan command's arguments) in one process: the plan
# command's own main, each answer after a marker line.
_PLAN_EACH = ("import json, sys\n"
              "from llamafactory_mca.launch.plan_command import main\n"
              "for argv in json.loads(sys.argv[1]):\n"
              "    print('@@ ' + ' '.join(argv), flush=True)\n"
              "    main(argv)\n")
MOE_ON_TWO = ["--gpus", "2", "--gpu-memory", "80"]


@pytest.fixture(scope="module")
def planned_recipes(tmp_path_factory):
    """Every recipe of RECIPES planned with its model's real config.json, from its hub id through a fake cache, as
    ``llamafactory-mca plan RECIPE --json`` plans it (one process for all: the command's start-up is most of its
    time); the MoE recipe also on two GPUs. {(recipe, extra args): (the printed lines, the JSON answer)}."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("plans")
    argvs, kinds = [], {}
    for name, (kind, _, _) in sorted(RECIPES.items()):
        path = os.path.join(ROOT, "examples", "megatron", name)
        with open(path) as f:
            repo = yaml.safe_load(f)["model_name_or_path"]
        if repo not in kinds:  # the dense recipes share Qwen3-1.7B
            shape = dict(SHAPES[kind] if isinstance(kind, str) else kind)
            model = root / "models" / name
            AutoConfig.for_model(shape.pop("model_type"), **shape).save_pretrained(model)
            fake_hub_cache(str(root / "hub"), repo, str(model))
        assert kinds.setdefault(repo, kind) == kind, (repo, kind)
        argvs.append([path, "--json"])
        if name == "qwen3_moe_full.yaml":
            argvs.append([path, "--json", *MOE_ON_TWO])
    env = cli_env(None, {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"})
    result, output = run([sys.executable, "-c", _PLAN_EACH, json.dumps(argvs)], env=env, timeout=600, alone=False)
    assert result.returncode == 0, output[-3000:]
    answers = {}
    for block in result.stdout.split("@@ ")[1:]:
        head, _, body = block.partition("\n")
        lines = body.strip().splitlines()
        path, *extra = head.split()
        answers[(os.path.basename(path), tuple(a for a in extra if a != "--json"))] = (body, json.loads(lines[-1]))
    return answers


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_example_recipes_fit_their_hardware(planned_recipes, name):
    """Each recipe, planned with its model's real config.json (from the hub id, through a fake cache) and nothing
    else, is planned for the GPUs its header names and fits them, and its weights are those of the full model (the
    shape is not a stand-in). The MoE recipe asked about fewer GPUs than its layout takes is searched there."""
    _, gpus, memory_gib = RECIPES[name]
    output, answer = planned_recipes[(name, ())]
    assert f"on {gpus} GPU(s) (the recipe's Hardware line)" in output, output
    assert answer["fits"] and answer["gpu_memory_gib"] == memory_gib, answer
    print(name, answer["layout"], answer["breakdown"], answer["needs_gib"])
    assert answer["breakdown"]["weights"] > 0.5, answer
    if name == "qwen3_moe_full.yaml":
        output, answer = planned_recipes[(name, tuple(MOE_ON_TWO))]
        assert answer["layouts"] == [] and "would fit: " in output, output


def test_launcher_refuses_a_run_that_does_not_fit(tmp_path, assets):
    """GPUs of 1 GiB (LLAMAFACTORY_MCA_GPU_MEMORY stands in for nvidia-smi): one line before any worker starts,
    naming the biggest term and the way out; nothing is left behind."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(assets, tmp_path / "out")))
    env = cli_env(1, {"LLAMAFACTORY_MCA_GPU_MEMORY": "1"})
    result, output = run(["llamafactory-cli", "train", str(path)], env=env, alone=False)
    one_error(result, output, "predicted to need", "the GPUs have 1 GiB", "the biggest term",
              "LLAMAFACTORY_MCA_SKIP_MEMORY_CHECK=1")
    assert "Megatron-Core backend" in output and "rank 0" not in output
    assert not (tmp_path / "out").exists()
