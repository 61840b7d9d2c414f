"""Training end to end through the real command: ``USE_MCA=1 llamafactory-cli train x.yaml`` on CPU (gloo).

A tiny Qwen3-shaped model (and a Qwen3-MoE one), a word-level tokenizer trained here and LLaMA-Factory
datasets in its own format. Every run is a subprocess, as a user would start it. (Every parallel layout's loss
is checked against Hugging Face's in one multi-process run: tests/test_layouts.py.)
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests._cli import DEFAULT_PATH_EAGER, default_path_losses, losses, ok, one_error, recipe, train
from tests._dist import run_distributed
from tests._reference import EAGER_REFERENCE
from tests.models._bridge import INPUT, pipeline_logits


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", ["pt", "sft", "dpo"])
def test_stage_trains_and_loss_falls(stage, assets, tmp_path):
    extra = {"pt": dict(dataset="tiny_text", dataset_dir=assets["pt"], save_strategy="steps", save_steps=3,
                        save_total_limit=1, save_hf_model=True),
             "dpo": dict(dataset="tiny_alpaca", dataset_dir=assets["dpo"], learning_rate=3e-4, pref_beta=0.1,
                         gradient_accumulation_steps=2),
             "sft": dict(plot_loss=True)}[stage]
    config = recipe(assets, tmp_path / "out", stage=stage, max_steps=6, sequence_packing=True, **extra)
    result, output = train(tmp_path, config)
    ok(result, output)
    curve = losses(tmp_path / "out")
    assert len(curve) == 6 and curve[6] < curve[1] - 0.05, curve
    assert "llamafactory_mca: training qwen3" in output and "global 8 = dp 1 x micro batch 2" in output \
        or stage == "dpo"
    if stage == "pt":  # plain (not distributed) optimizer checkpoints; save_total_limit keeps the newest
        assert sorted(n for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint")) == ["checkpoint-6"]
        _check_checkpoint_hf(tmp_path / "out" / "checkpoint-6", tmp_path / "merged")  # save_hf_model
    if stage == "sft":
        assert (tmp_path / "out" / "training_loss.png").is_file()
        assert "1 reach cutoff_len and were truncated" in output  # the long row
        # an empty conversation is kept, as LLaMA-Factory's default path keeps it (its end token carries loss), counted
        assert "data (sft): 50 rows, 50 kept, 1 empty (nothing but template tokens) (dropped 0" in output
        assert output.count("dataset=tiny_alpaca: 1 empty (nothing but the chat template's tokens) of 50 rows") == 1
    if stage == "dpo":
        with open(tmp_path / "out" / "trainer_log.jsonl") as f:
            first = json.loads(f.readline())
        assert abs(first["loss"] - 0.6931) < 1e-3  # policy == reference at step 1


def _check_checkpoint_hf(checkpoint, merged) -> None:
    """save_hf_model: checkpoint-N/hf/ is what transformers loads as is (model and tokenizer), with the merged
    checkpoint's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "hf")
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    merge = [sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path", str(checkpoint),
             "--output_path", str(merged)]
    result = subprocess.run(merge, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logits = []
    for folder in (checkpoint / "hf", merged):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(INPUT.clamp(max=model.config.vocab_size - 1)).logits)
    assert torch.equal(logits[0], logits[1])


def test_freeze_and_evaluation(assets, tmp_path):
    """finetuning_type freeze trains only the chosen layers; val_size + eval_steps evaluate during training."""
    from safetensors.torch import load_file

    config = recipe(assets, tmp_path / "out", finetuning_type="freeze", freeze_trainable_layers=1,
                    freeze_trainable_modules="all", max_steps=4, val_size=0.1, eval_strategy="steps", eval_steps=2)
    result, output = train(tmp_path, config)
    ok(result, output)
    with open(tmp_path / "out" / "trainer_log.jsonl") as f:
        evals = [json.loads(line)["eval_loss"] for line in f if "eval_loss" in line]
    assert len(evals) == 2 and all(0 < v < 20 for v in evals), evals
    before = load_file(os.path.join(assets["models"]["qwen3"], "model.safetensors"))
    after = load_file(tmp_path / "out" / "model.safetensors")
    last = f"model.layers.{len([k for k in before if k.endswith('input_layernorm.weight')]) - 1}."
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor) != key.startswith(last), key  # only the last layer moved


def test_freeze_tuning_leaves_what_transformers_never_trains(assets, tmp_path):
    """GLM-5's indexer runs without gradient in transformers: freeze-tuning its last two layers at DP2 with the grads'
    reduce overlapped (which waits for a gradient of every trainable parameter) trains their attention and MLP and
    leaves their indexers as loaded."""
    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model("glm_moe_dsa", str(tmp_path / "glm5"), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    config = recipe(assets, tmp_path / "out", model_name_or_path=model, finetuning_type="freeze",
                    freeze_trainable_layers=2, use_distributed_optimizer=True, overlap_grad_reduce=True,
                    weight_decay=0.1)
    result, output = train(tmp_path, config, world=2)
    ok(result, output)
    before, after = _weights(model), _weights(tmp_path / "out")
    trained = "model.layers.3.self_attn.q_b_proj.weight"
    assert not torch.equal(before[trained], after[trained])
    for name in ("wq_b.weight", "wk.weight", "k_norm.bias", "weights_proj.weight"):
        key = f"model.layers.3.self_attn.indexer.{name}"
        assert torch.equal(before[key], after[key]), key


def test_fusion_keys_train_what_the_plain_path_trains(assets, tmp_path):
    """``apply_rope_fusion`` and ``qk_norm_fusion`` (on by default on GPUs unless only adapters train) through the real
    command: packed, with evaluation between steps, the losses equal the unfused run's (on CPU the fused functions run
    eagerly: the same math through megatron-core's fused-RoPE slots), and the startup summary names them."""
    runs = {}
    for fused in (False, True):
        name = f"fused_{fused}"
        config = recipe(assets, tmp_path / name, sequence_packing=True, max_steps=3, eval_dataset="tiny_alpaca",
                        eval_strategy="steps", eval_steps=2, apply_rope_fusion=fused, qk_norm_fusion=fused)
        result, output = train(tmp_path, config, name=name)
        ok(result, output)
        assert ("Triton: RoPE and q/k norms" in output) == fused, output[-3000:]
        runs[fused] = losses(tmp_path / name)
    assert runs[True].keys() == {1, 2, 3} and runs[True] == runs[False]


def _megatron_logits(checkpoint: str) -> torch.Tensor:
    from llamafactory_mca import parallel
    from llamafactory_mca.models.auto import AutoModel

    parallel.initialize(parallel.ParallelLayout(1, 1, 1, None, 1, 1, 1, 1, 1, 1, 1))
    model = AutoModel.from_pretrained(checkpoint)
    model.eval()
    return pipeline_logits(model, INPUT.clamp(max=model.config.vocab_size - 1))


def test_crash_resume_merge(assets, tmp_path):
    """Kill in the middle of writing the second checkpoint; resume (onto another DP size) continues
    from the newest complete checkpoint with the uninterrupted run's losses; the merge gives a model
    transformers loads with the trained Megatron model's logits."""
    from transformers import AutoModelForCausalLM

    # 25 micro-batches per epoch, 4 per step at DP2: the epoch's last step (7) has one, step 8 starts epoch 2
    config = dict(max_steps=8, save_steps=4, save_strategy="steps", gradient_accumulation_steps=2,
                  use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                  include_num_input_tokens_seen=True)
    reference, output = train(tmp_path, recipe(assets, tmp_path / "ref", **config), world=2, name="ref")
    ok(reference, output)
    expected = losses(tmp_path / "ref")

    out = tmp_path / "crash"
    run = recipe(assets, out, **config)
    crashed, output = train(tmp_path, run, world=2, env={"LLAMAFACTORY_MCA_FAULT": "save:8"}, name="c1")
    assert crashed.returncode != 0 and "crashing on purpose" in output
    assert (out / "checkpoint-4").is_dir() and (out / "tmp-checkpoint-8").is_dir()
    assert not (out / "checkpoint-8").exists()
    assert losses(out)[7] == pytest.approx(expected[7], rel=1e-5)

    run["overwrite_output_dir"] = False  # LLaMA-Factory then resumes from the newest checkpoint by itself

    resumed, output = train(tmp_path, {**run, "gradient_accumulation_steps": 4}, world=1, name="c2")  # dp 2 -> 1
    ok(resumed, output)
    assert "Resumed from" in output and "checkpoint-4" in output
    got = losses(out)
    for step in (5, 6, 7, 8):  # the same samples in the same order, across the epoch's end
        assert got[step] == pytest.approx(expected[step], rel=1e-4), (step, got, expected)
    assert (out / "checkpoint-8").is_dir() and not (out / "tmp-checkpoint-8").exists()
    with open(out / "trainer_state.json") as f, open(tmp_path / "ref" / "trainer_state.json") as g:
        resumed_state, reference_state = json.load(f), json.load(g)
    assert resumed_state["num_input_tokens_seen"] == reference_state["num_input_tokens_seen"] > 0
    assert resumed_state["epoch"] == pytest.approx(reference_state["epoch"]) == pytest.approx(29 / 25)  # 25 + 4

    merged = tmp_path / "merged"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path",
                             str(out / "checkpoint-8"), "--output_path", str(merged)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = INPUT.clamp(max=hf.config.vocab_size - 1)
    with torch.no_grad():
        hf_logits = hf(ids).logits
    (megatron,) = run_distributed(_megatron_logits, 1, str(out / "checkpoint-8"))
    megatron = megatron[..., : hf_logits.shape[-1]]  # the padded vocabulary rows are not exported
    assert torch.allclose(hf_logits, megatron, atol=1e-4), (hf_logits - megatron).abs().max()
    assert (merged / "tokenizer_config.json").is_file()


# (an unsupported stage and a missing dataset: tests/test_first_hour.py)
@pytest.mark.parametrize("overrides,message", [
    ({"finetuning_type": "oft"}, "finetuning_type='oft' is not supported with USE_MCA=1"),
    ({"output_dir": "/proc/forbidden/out"}, "is not writable"),
    ({"resume_from_checkpoint": "NOT_A_CHECKPOINT"}, "is not a llamafactory_mca checkpoint"),
])
def test_bad_input_fails_clearly_and_writes_nothing(overrides, message, assets, tmp_path):
    if overrides.get("resume_from_checkpoint"):
        (tmp_path / "plain").mkdir()
        overrides = {"resume_from_checkpoint": str(tmp_path / "plain")}
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", **overrides), alone=False)
    one_error(result, output, message)
    out = tmp_path / "out"
    assert not out.exists() or not any(n.startswith("checkpoint") for n in os.listdir(out))


@pytest.mark.parametrize("keys,message", [
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 2},
     "expert_tensor_parallel_size=2: the experts' biases need each expert whole on its rank"),
    ({"moe_grouped_gemm": False}, "moe_grouped_gemm=False, but this model's experts have biases"),
])
def test_gpt_oss_layouts_its_biased_experts_cannot_take_are_refused(keys, message, assets, tmp_path):
    """gpt-oss's biased experts run whole on their rank and grouped (``native/experts.py``): asking otherwise is one
    line naming the key and the fix, before any worker starts."""
    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model("gpt_oss", str(tmp_path / "gpt_oss"), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=model, **keys), world=2,
                           alone=False)
    one_error(result, output, message)
    assert "Loaded gpt_oss" not in output and not (tmp_path / "out").exists()


def test_a_dataset_of_empty_rows_is_refused(assets, tmp_path):
    """Alpaca rows whose fields are all empty would train on the template's end-of-turn token alone: one line, before
    the model loads (the counting itself, for sft, dpo and pt: tests/data/test_content.py)."""
    from llamafactory_mca.tools.tiny import write_alpaca_dataset

    rows = [{"instruction": "", "input": "", "output": ""}] * 8
    config = recipe(assets, tmp_path / "out", dataset_dir=write_alpaca_dataset(str(tmp_path / "empty"), 0, rows=rows))
    result, output = train(tmp_path, config)
    one_error(result, output, "dataset=tiny_alpaca: nothing but the chat template's tokens would carry loss in its 8 "
              "rows (8 empty, 0 with an empty answer)")
    assert "Loaded qwen3" not in output


def _sft(family: str, assets, tmp_path, model: str, name: str = "out", **overrides) -> tuple[dict, str, dict]:
    """Four sft steps of the tiny ``family`` model in ``model`` through the real command, on 8 rows, into
    ``tmp_path / name``; the loss falls. Returns (our losses, our log, the recipe)."""
    from llamafactory_mca.tools.tiny import model_type_of

    config = recipe(assets, tmp_path / name, model_name_or_path=model, max_samples=8, max_steps=4, **overrides)
    result, output = train(tmp_path, config, name=name)
    ok(result, output)
    ours = losses(tmp_path / name)
    assert f"llamafactory_mca: training {model_type_of(family)}" in output and ours[4] < ours[1], ours
    return ours, output, config


def _first_loss_is(ours: dict, theirs: float) -> None:
    assert abs(ours[1] - theirs) <= 1e-4 * theirs, (ours[1], theirs)


def _sft_against_default(family: str, assets, tmp_path, **overrides) -> tuple[dict, float, str, str, str]:
    """Four sft steps of a tiny ``family`` model through the real command (checkpoint-4 merged), and one step of
    LLaMA-Factory's default path on the same rows (8 rows, one global batch of all of them: row order cannot
    matter; gpt-oss and GLM-5 with transformers' eager attention, ``DEFAULT_PATH_EAGER``). Returns (our losses, the
    default path's step-1 loss, our log, the model's folder, the merged one)."""

    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model(family, str(tmp_path / family), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    ours, output, config = _sft(family, assets, tmp_path, model, save_strategy="steps", save_steps=4, **overrides)

    default = {k: v for k, v in config.items() if k not in ("save_strategy", "save_steps")} | {"max_steps": 1}
    command = [sys.executable, "-c", DEFAULT_PATH_EAGER] if family in EAGER_REFERENCE else ["llamafactory-cli"]
    theirs = default_path_losses(tmp_path, default, command=command)[1]
    _first_loss_is(ours, theirs)

    merged = tmp_path / "merged"
    merge = [sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path",
             str(tmp_path / "out" / "checkpoint-4"), "--output_path", str(merged)]
    result = subprocess.run(merge, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return ours, theirs, output, model, str(merged)


@pytest.mark.parametrize("family,hf_class", [("glm4_moe", "Glm4MoeForCausalLM"),
                                             ("deepseek_v3", "DeepseekV3ForCausalLM")])
def test_deepseek_style_moe_sft_matches_llamafactory_and_merges(family, hf_class, assets, tmp_path):
    """GLM-4.5's and DeepSeek-V3's layouts (dense first layer, sigmoid routing with a correction bias, shared expert;
    GLM: partial RoPE, q/k/v biases, qk-norm; DeepSeek: multi-latent attention with YaRN) through the real command:
    step 1's loss is LLaMA-Factory's default path's, the loss falls, and the merged checkpoint is a Hugging Face
    model transformers loads. Both tiny models carry a multi-token-prediction layer: it trains (its loss is logged
    beside the next-token loss, which stays the one compared) and is merged back with its copies of the embedding
    and output layer."""
    from transformers import AutoModelForCausalLM

    _, _, output, model, merged = _sft_against_default(family, assets, tmp_path)
    assert "| mtp loss " in output, output[-3000:]
    assert f"training {family} with 1 multi-token-prediction layer(s), loss weight 0.1" in output
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    trained = dict(hf.named_buffers())["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert type(hf).__name__ == hf_class and torch.isfinite(trained).all()
    start, end = _weights(model), _weights(merged)
    mtp = "model.layers.4."
    assert {k for k in start if k.startswith(mtp)} == {k for k in end if k.startswith(mtp)}
    assert not torch.equal(start[mtp + "eh_proj.weight"], end[mtp + "eh_proj.weight"])  # trained
    assert torch.equal(end[mtp + "embed_tokens.weight"], end["model.embed_tokens.weight"])
    assert torch.equal(end[mtp + "shared_head.head.weight"], end["lm_head.weight"])


def test_qwen3_next_sft_packed_matches_llamafactory_and_merges(assets, tmp_path):
    """Qwen3-Next's hybrid layers (gated delta rule and gated attention in turn, MoE with a gated shared expert)
    through the real command, packed: the recurrent state and the convolution restart at every sequence, so step 1's
    loss is LLaMA-Factory's default (unpacked, padded) path's; the loss falls; the merged checkpoint is a
    Qwen3NextForCausalLM with every tensor of the original, the delta-rule layers' trained. Its multi-token-prediction
    layer (stored under mtp.) trains beside it, logged apart, and is merged back under the same names."""
    from transformers import AutoModelForCausalLM

    _, _, output, model, merged = _sft_against_default("qwen3_next", assets, tmp_path, sequence_packing=True)
    assert "gated delta rule: torch chunked rule" in output
    assert "| mtp loss " in output and "training qwen3_next with 1 multi-token-prediction layer(s)" in output
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    start, end = _weights(model), _weights(merged)
    assert set(start) == set(end)
    for name in ("model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.A_log",
                 "model.layers.2.linear_attn.conv1d.weight", "model.layers.1.self_attn.q_proj.weight",
                 "mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.pre_fc_norm_hidden.weight"):
        assert not torch.equal(start[name], end[name]), name


# family: (what the startup summary names, the LoRA targets it lists, the merged model's class, tensors that must move)
PACKED_FAMILIES = {
    # MiniMax-M2: q/k norms across all heads, RoPE on half of each head, sigmoid routing with the correction bias on
    # the MoE block; LLaMA-Factory's `all` is the attention's projections (the experts are 3-D parameters)
    "minimax_m2": (("q/k norms across all heads",), ("q_proj", "v_proj"), "MiniMaxM2ForCausalLM",
                   ("model.layers.1.self_attn.q_norm.weight", "model.layers.2.self_attn.k_norm.weight",
                    "model.layers.0.block_sparse_moe.experts.1.w3.weight",
                    "model.layers.3.block_sparse_moe.gate.weight")),
    # Gemma 3's decoder: sandwich norms, scaled embeddings, tanh GeGLU, windows of 6 tokens on three of four layers
    # with their own RoPE base
    "gemma3_text": (("sliding window 6 tokens on 3 of 4 layers",), ("o_proj", "down_proj"), "Gemma3ForCausalLM",
                    ("model.layers.1.post_attention_layernorm.weight",
                     "model.layers.3.post_feedforward_layernorm.weight",
                     "model.layers.0.pre_feedforward_layernorm.weight", "model.layers.2.self_attn.q_norm.weight")),
    # Gemma 4's dense decoder: windows of 6 on every other layer, the full-attention layers' wider heads whose keys are
    # the values, the values' norm, layer scalars (stored, never trained), soft-capped logits
    "gemma4_text": (("sliding window 6 tokens on 2 of 4 layers",
                     "full-attention layers: heads of 32, 2 key/value heads (the keys are the values), RoPE on 25% of "
                     "each head (base 1e+06)",
                     "logits soft-capped at 3 inside the loss's passes, in fp32"),
                    ("o_proj", "q_proj"), "Gemma4ForCausalLM",
                    ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                     "model.layers.0.self_attn.v_proj.weight", "model.layers.3.self_attn.k_norm.weight",
                     "model.layers.2.post_feedforward_layernorm.weight")),
    # Gemma 4's MoE block (the 26B-A4B's): a dense MLP and routed experts side by side, each under its own norms, a
    # router with its own input scale and per-expert scales; `all` puts an adapter on the router's projection too
    "gemma4_text_moe": (("MoE experts: ", "beside a dense MLP of 96 in every layer, each under its own norms"),
                        ("o_proj", "proj"), "Gemma4ForCausalLM",
                        ("model.layers.0.router.proj.weight", "model.layers.1.router.per_expert_scale",
                         "model.layers.2.router.scale", "model.layers.3.experts.gate_up_proj",
                         "model.layers.0.experts.down_proj", "model.layers.1.mlp.down_proj.weight",
                         "model.layers.2.post_feedforward_layernorm_2.weight",
                         "model.layers.3.pre_feedforward_layernorm_2.weight",
                         "model.layers.0.post_feedforward_layernorm_1.weight")),
    # Gemma 4 as the hub stores it: the same decoder under model.language_model. beside a vision tower and its
    # embedder, which stay frozen (LLaMA-Factory's default) and merge back as loaded; text rows
    "gemma4": (("sliding window 6 tokens on 2 of 4 layers",), ("o_proj", "q_proj"), "Gemma4ForConditionalGeneration",
               ("model.language_model.layers.1.self_attn.q_proj.weight",
                "model.language_model.layers.0.self_attn.v_proj.weight",
                "model.language_model.layers.3.self_attn.k_norm.weight")),
    # Gemma 4's E2B/E4B as the hub stores them: per-layer inputs, the last layers attending with earlier layers'
    # keys and values, their MLP twice as wide, an audio tower carried along untouched (and the vision tower, frozen)
    "gemma4_e2b": (("per-layer inputs of 8 per layer",
                    "the last 3 layers attend with earlier layers' keys and values, their MLP twice as wide"),
                   ("per_layer_model_projection", "per_layer_input_gate"), "Gemma4ForConditionalGeneration",
                   ("model.language_model.embed_tokens_per_layer.weight",
                    "model.language_model.per_layer_model_projection.weight",
                    "model.language_model.per_layer_projection_norm.weight",
                    "model.language_model.layers.4.per_layer_input_gate.weight",
                    "model.language_model.layers.3.per_layer_projection.weight",
                    "model.language_model.layers.5.post_per_layer_input_norm.weight",
                    "model.language_model.layers.5.mlp.up_proj.weight",
                    "model.language_model.layers.1.self_attn.k_proj.weight",
                    "model.language_model.layers.4.self_attn.q_proj.weight")),
    # gpt-oss: sinks, biases everywhere, windows of 6 on every other layer, YaRN, biased experts stored interleaved,
    # the clamped SwiGLU; LLaMA-Factory's `all` is the attention's projections (the experts are 3-D parameters), and
    # its default path runs transformers' eager attention here (``DEFAULT_PATH_EAGER``)
    "gpt_oss": (("sliding window 6 tokens on 2 of 4 layers", "attention sinks (learnable): fp32 scores per sequence"),
                ("o_proj", "q_proj"), "GptOssForCausalLM",
                ("model.layers.1.self_attn.sinks", "model.layers.0.self_attn.o_proj.bias",
                 "model.layers.2.mlp.router.bias", "model.layers.3.mlp.experts.gate_up_proj_bias",
                 "model.layers.0.mlp.experts.down_proj_bias", "model.layers.1.mlp.experts.gate_up_proj")),
    # GLM-5: DeepSeek-V3's MLA and MoE with sparse attention (an indexer choosing 5 keys per query of rows of up to
    # 64 tokens), LLaMA-Factory's default path with transformers' eager attention (``DEFAULT_PATH_EAGER``); the
    # indexer stays as loaded (transformers runs it without gradient), and `all` leaves its linears out
    "glm_moe_dsa": (("DeepSeek sparse attention: the lightning indexer's top 5 keys per query",),
                    ("q_b_proj", "kv_a_proj_with_mqa"), "GlmMoeDsaForCausalLM",
                    ("model.layers.1.self_attn.q_b_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                     "model.layers.2.mlp.gate.weight", "model.layers.3.mlp.shared_experts.down_proj.weight")),
}
# transformers' Trainer averages the micro-batches' means for a model that takes no loss arguments (Gemma 4's VL class,
# accepts_loss_kwargs = False), where we average the global batch's tokens: the step in one micro-batch compares them
ONE_MICRO_BATCH = {name: dict(per_device_train_batch_size=8, gradient_accumulation_steps=1)
                   for name in ("gemma4", "gemma4_e2b")}
FROZEN = {"glm_moe_dsa": ("model.layers.1.self_attn.indexer.wq_b.weight", "model.layers.2.self_attn.indexer.wk.weight",
                          "model.layers.3.self_attn.indexer.k_norm.bias"),
          "gemma4_text": ("model.layers.0.layer_scalar", "model.layers.3.layer_scalar"),
          "gemma4_text_moe": ("model.layers.1.layer_scalar",),
          "gemma4": ("model.language_model.layers.1.layer_scalar", "model.embed_vision.embedding_projection.weight",
                     "model.vision_tower.encoder.layers.1.self_attn.q_proj.linear.weight"),
          "gemma4_e2b": ("model.audio_tower.layers.0.feed_forward1.ffw_layer_1.linear.weight",
                         "model.embed_audio.embedding_projection.weight",
                         "model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight")}


@pytest.mark.parametrize("family", list(PACKED_FAMILIES))
def test_sft_packed_matches_llamafactory_and_merges(family, assets, tmp_path):
    """A family's layout through the real command, packed, full and LoRA on every linear (``lora_target: all``): step
    1's loss is LLaMA-Factory's default (unpacked, padded) path's, the loss falls, the startup summary names the
    windows (and sinks), and the full run's merged checkpoint is the family's HF class with every tensor of the
    original, the family's own ones trained. LoRA's B matrices start at zero, so its step 1 is the base model's loss:
    the full run's reference holds it too."""
    from transformers import AutoModelForCausalLM

    summary, lora_targets, hf_class, moved = PACKED_FAMILIES[family]
    same = dict(sequence_packing=True, **ONE_MICRO_BATCH.get(family, {}))
    _, theirs, output, model, merged = _sft_against_default(family, assets, tmp_path, **same)
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert type(hf).__name__ == hf_class
    start, end = _weights(model), _weights(merged)
    assert set(start) == set(end)
    for name in moved:
        assert not torch.equal(start[name], end[name]), name
    for name in FROZEN.get(family, ()):
        assert torch.equal(start[name], end[name]), name

    lora, lora_output, _ = _sft(family, assets, tmp_path, model, name="lora", finetuning_type="lora",
                                lora_target="all", lora_rank=4, learning_rate=1e-2, **same)
    _first_loss_is(lora, theirs)
    for log in (output, lora_output):
        for line in summary:
            assert line in log, log[-3000:]
    assert "LoRA rank 4" in lora_output and all(target in lora_output for target in lora_targets)


def test_moe_balancing_trains_as_llamafactorys_default_path_unless_asked(assets, tmp_path):
    """A Qwen3-MoE checkpoint carrying router_aux_loss_coef 0.5. Where the recipe is silent no load-balancing loss
    trains, as in LLaMA-Factory's default path: ten steps of both paths over the same eight rows (one global batch of
    all of them each step: row order cannot matter) give the same losses. ``moe_balancing: checkpoint`` trains the
    checkpoint's term, named in the summary and logged apart (the progress line, trainer_state.json;
    trainer_log.jsonl keeps LLaMA-Factory's keys): step 1's loss is the same language-model loss, step 2 differs
    (the term trained the routers). Packed on a GPU the planner takes to be 80 GiB, ``merge_micro_batches: auto``
    runs the step's four micro-batches as one (64 rows per expert each) and trains the same ten steps."""

    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model("qwen3_moe", str(tmp_path / "model"), vocab_size=assets["vocab"], router_aux_loss_coef=0.5)
    save_tiny_tokenizer(model)
    runs = {}
    for name, extra, env in (("default", {"max_steps": 10}, None),
                             ("checkpoint", {"moe_balancing": "checkpoint"}, None),
                             ("merged", {"max_steps": 10, "sequence_packing": True},
                              {"LLAMAFACTORY_MCA_GPU_MEMORY": "80"})):
        config = recipe(assets, tmp_path / name, model_name_or_path=model, max_samples=8, **extra)
        result, output = train(tmp_path, config, name=name, env=env)
        ok(result, output)
        with open(tmp_path / name / "trainer_state.json") as f:
            history = [entry for entry in json.load(f)["log_history"] if "loss" in entry]
        with open(tmp_path / name / "trainer_log.jsonl") as f:
            keys = {key for line in f for key in json.loads(line)}
        assert "loss" in keys and not any("moe" in key or "balancing" in key for key in keys), keys
        runs[name] = losses(tmp_path / name), history, output
    (ours, plain_history, plain_output), (on, on_history, on_output) = runs["default"], runs["checkpoint"]
    merged, _, merged_output = runs["merged"]
    assert ("global 8 = dp 1 x micro batch 8 x grad accumulation 1; ~351 tokens per step (packed); "
            "merge_micro_batches: auto merged the recipe's micro-batches by 4 (256 rows per expert; 1 keeps them)"
            ) in merged_output
    assert all(abs(merged[k] - ours[k]) <= 1e-4 * ours[k] for k in ours), (merged, ours)
    assert ("MoE         no load-balancing loss, as in LLaMA-Factory's default path (moe_aux_loss_coef sets a weight; "
            "moe_balancing: checkpoint trains the checkpoint's router_aux_loss_coef)") in plain_output
    assert "| load_balancing_loss " not in plain_output
    assert not any("moe/load_balancing_loss" in e for e in plain_history)
    assert ("MoE         load-balancing loss aux_loss x 0.5 (the checkpoint's router_aux_loss_coef), logged apart as "
            "load_balancing_loss: loss is the language-model loss") in on_output
    assert "| load_balancing_loss " in on_output and all(0.5 < e["moe/load_balancing_loss"] < 4 for e in on_history)
    assert on[1] == pytest.approx(ours[1], rel=1e-6) and abs(on[2] - ours[2]) > 1e-6, (on, ours)

    theirs = default_path_losses(tmp_path, recipe(assets, tmp_path / "lf", model_name_or_path=model, max_samples=8,
                                                  max_steps=10), "lf")
    assert sorted(theirs) == sorted(ours) == list(range(1, 11))
    assert all(abs(ours[k] - theirs[k]) <= 1e-3 * theirs[k] for k in theirs), (ours, theirs)


def _weights(directory) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in os.listdir(directory) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(directory, f)).items()}


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_deepseek_style_moe_dpo_trains(family, assets, tmp_path):
    """DPO on GLM-4.5's and DeepSeek-V3's layouts through the real command: the reference is the starting model
    (ln 2 at step 1), the loss falls, and the run says once why its multi-token-prediction layer is not trained:
    DeepSeek's because this is dpo; GLM's checkpoint was saved by transformers (as a model fine-tuned by
    LLaMA-Factory's default path is), which declares the layer in config.json but drops its weights. GLM's routing
    stays aux-loss-free; DeepSeek's recipe asks for moe_aux_loss_coef, which adds the sequence-wise balancing loss
    beside the expert bias: logged apart, so step 1's loss is still ln 2."""
    from transformers import AutoModelForCausalLM

    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model(family, str(tmp_path / "tiny"), vocab_size=assets["vocab"])
    if family == "glm4_moe":
        AutoModelForCausalLM.from_pretrained(model).save_pretrained(tmp_path / "resaved")
        model = str(tmp_path / "resaved")
    save_tiny_tokenizer(model)
    balancing = {"moe_aux_loss_coef": 0.01} if family == "deepseek_v3" else {}
    config = recipe(assets, tmp_path / "dpo", model_name_or_path=model, stage="dpo", dataset="tiny_alpaca",
                    dataset_dir=assets["dpo"], pref_beta=0.1, learning_rate=3e-4, gradient_accumulation_steps=2,
                    max_steps=4, **balancing)
    result, output = train(tmp_path, config)
    ok(result, output)
    curve = losses(tmp_path / "dpo")
    assert abs(curve[1] - 0.6931) < 1e-3 and curve[4] < curve[1], curve
    if balancing:
        assert "seq_aux_loss x 0.01 (moe_aux_loss_coef), logged apart as seq_load_balancing_loss" in output
        assert "| seq_load_balancing_loss " in output, output[-3000:]
    else:
        assert ("MoE         routing with the checkpoint's expert bias, held as loaded (LLaMA-Factory's default path; "
                "moe_balancing: checkpoint updates it); no load-balancing loss") in output
    said = "holds no weights for them" if family == "glm4_moe" else "layer(s) are not trained in a dpo run"
    assert output.count(said) == 1, output[-3000:]
