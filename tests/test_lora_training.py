"""``finetuning_type: lora`` through the real command: sft and dpo train, checkpoints hold only adapters and resume,
the run leaves a peft adapter, ``megatron_merge.py --merge_lora`` writes a full model transformers loads, and adapters
move both ways between our path and LLaMA-Factory's default path with the same first-step loss. (peft parity and the
layouts: tests/models/test_lora.py, tests/test_layouts.py.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests._cli import default_path_losses, losses, ok, one_error, recipe, train
from tests.models._bridge import INPUT


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Unsupported layer type")]
LORA = dict(finetuning_type="lora", lora_rank=8, lora_alpha=16, lora_target="all", learning_rate=5e-3)


def _stored_keys(checkpoint) -> list[str]:
    from llamafactory_mca.checkpoints.dist_reader import DistCheckpointReader

    return [k for k in DistCheckpointReader(str(checkpoint / "dist_ckpt")).keys() if not k.startswith("optimizer.")]


@pytest.fixture(scope="module")
def lora_run(assets, tmp_path_factory):
    """One LoRA sft run (DP2, distributed optimizer, packed), saving at steps 3 and 6 with save_hf_model."""
    tmp_path = tmp_path_factory.mktemp("lora_run")
    config = recipe(assets, tmp_path / "out", max_steps=6, save_strategy="steps", save_steps=3, save_hf_model=True,
                    sequence_packing=True, use_distributed_optimizer=True, **LORA)
    result, output = train(tmp_path, config, world=2)
    ok(result, output)
    return tmp_path, config, output


def test_lora_sft_checkpoints_resume_merge(assets, lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp_path, config, output = lora_run
    out = tmp_path / "out"
    curve = losses(out)
    assert curve[6] < curve[1] - 0.05, curve
    assert "tuning      LoRA rank 8, alpha 16, dropout 0 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, " \
           "v_proj" in output, output
    keys = _stored_keys(out / "checkpoint-3")
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys  # the frozen base is not saved
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()
    assert (out / "checkpoint-6" / "hf" / "adapter_model.safetensors").is_file()

    # resume from checkpoint-3 (another data-parallel size): the same steps 4-6
    resumed = {**config, "output_dir": str(tmp_path / "resumed"), "resume_from_checkpoint": str(out / "checkpoint-3"),
               "gradient_accumulation_steps": 8}
    result, output = train(tmp_path, resumed, world=1, name="resume")
    ok(result, output)
    got = losses(tmp_path / "resumed")
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(curve[step], rel=1e-4), (step, got, curve)

    # merge: the base with the adapter folded in, as peft computes it
    merged = tmp_path / "merged"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path",
                             str(out / "checkpoint-6"), "--output_path", str(merged), "--merge_lora"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ids = INPUT.clamp(max=assets["vocab"] - 1)
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(assets["models"]["qwen3"], dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, str(out)).eval()(ids).logits
    assert (full - adapted).abs().max().item() < 1e-4
    assert (merged / "tokenizer_config.json").is_file()


def test_adapters_move_both_ways_with_llamafactory(assets, lora_run, tmp_path):
    """LLaMA-Factory's default path continues our adapter for two steps, saving after the first: its step-1 loss is
    ours on our adapter, and its step-2 loss (on the adapter it saved at step 1) is ours on that adapter. 8 rows, one
    global batch of all of them: both steps see the same rows, and row order cannot matter."""
    ours = str(lora_run[0] / "out")
    one_step = dict(LORA, max_samples=8, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=1)
    config = recipe(assets, tmp_path / "default", adapter_name_or_path=ours, **one_step)
    theirs = default_path_losses(tmp_path, {**config, "max_steps": 2, "save_strategy": "steps", "save_steps": 1})
    for step, adapter in ((1, ours), (2, str(tmp_path / "default" / "checkpoint-1"))):
        run_dir = tmp_path / f"mca-{step}"
        ok(*train(tmp_path, {**config, "adapter_name_or_path": adapter, "output_dir": str(run_dir)}, name=f"m{step}"))
        assert losses(run_dir)[1] == pytest.approx(theirs[step], rel=1e-5, abs=1e-6), (step, losses(run_dir), theirs)


def test_lora_dpo_reference_is_the_base(assets, lora_run, tmp_path):
    """DPO with LoRA: the reference is the model with its adapter off (peft's disable_adapter, as LLaMA-Factory
    does), so continuing a trained adapter starts away from ln 2; the loss falls."""
    config = recipe(assets, tmp_path / "dpo", stage="dpo", dataset="tiny_alpaca", dataset_dir=assets["dpo"],
                    pref_beta=0.1, gradient_accumulation_steps=2, max_steps=6, sequence_packing=True,
                    adapter_name_or_path=str(lora_run[0] / "out"), **dict(LORA, learning_rate=2e-3))
    result, output = train(tmp_path, config, world=2, name="dpo")
    ok(result, output)
    curve = losses(tmp_path / "dpo")
    assert abs(curve[1] - 0.6931) > 1e-3 and curve[6] < curve[1], curve
    with open(tmp_path / "dpo" / "adapter_config.json") as f:
        assert json.load(f)["r"] == 8


@pytest.mark.parametrize("overrides,message", [
    ({"use_dora": True}, "use_dora=True (DoRA) is not supported with USE_MCA=1"),
    ({"lora_target": "q_proj,qkv_proj"}, "lora_target ['qkv_proj'] names modules"),
    ({"adapter_name_or_path": "/no/such/adapter"}, "is not a peft adapter folder"),
])
def test_lora_mistakes_are_one_line(overrides, message, assets, tmp_path):
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", **{**LORA, **overrides}), alone=False)
    one_error(result, output, message)
    assert not (tmp_path / "out").exists()


def test_expert_adapters_refuse_dropout():
    """peft's expert adapters (target_parameters) take no dropout: refused, or the saved adapter would not load."""
    from types import SimpleNamespace

    from llamafactory_mca.errors import UserError
    from llamafactory_mca.models.lora.targets import check_lora_request

    args = SimpleNamespace(lora_rank=8, lora_target=["all", "experts"], lora_dropout=0.1)
    with pytest.raises(UserError, match="lora_dropout=0.1 with lora_target 'experts'"):
        check_lora_request(args)


def test_adapter_targets_read_as_peft_matches_them():
    """An adapter's full module names (LLaMA-Factory's VL adapters) read as their last names, once each; a regular
    expression is refused by name."""
    from llamafactory_mca.errors import UserError
    from llamafactory_mca.models.lora.targets import LoraSettings

    full = ["model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.1.self_attn.q_proj",
            "model.language_model.layers.0.mlp.down_proj"]
    assert LoraSettings.from_peft({"r": 4, "lora_alpha": 8, "target_modules": full}).targets == ("q_proj", "down_proj")
    with pytest.raises(UserError, match=r"target_modules='\^\.\*q_proj\$' in the adapter's adapter_config.json is a "
                                        "regular expression"):
        LoraSettings.from_peft({"r": 4, "lora_alpha": 8, "target_modules": "^.*q_proj$"})


def test_lora_on_qwen3_next_trains_through_the_real_command(assets, tmp_path):
    """Qwen3-Next with ``lora_target: all`` (the gated delta-rule layers' fused in_proj and out_proj, the gated
    attention, the shared expert and its gate) at TP2 + SP, packed: the loss falls and the peft adapter it leaves
    holds every module kind. (peft's logits from such adapters and their export: tests/models/test_lora.py.)"""
    from safetensors.torch import load_file

    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model("qwen3_next", str(tmp_path / "qwen3_next"), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    config = recipe(assets, tmp_path / "out", model_name_or_path=model, max_steps=3, sequence_packing=True,
                    tensor_model_parallel_size=2, sequence_parallel=True, **LORA)
    ok(*train(tmp_path, config, world=2))
    curve = losses(tmp_path / "out")
    assert curve[3] < curve[1], curve
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    for module in ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj", "self_attn.q_proj",
                   "mlp.shared_expert.up_proj", "mlp.shared_expert_gate"):
        assert any(f".{module}.lora_B" in key for key in adapter), module
