"""``stage: rm`` through the real command: LLaMA-Factory's pairwise reward model on the Megatron path.

The tiny Qwen3 model carries a value_head.safetensors (trl's keys) and ``summary_dropout_prob: 0`` in its config,
so LLaMA-Factory's default path (trl's AutoModelForCausalLMWithValueHead) and ours start from the same head and
score without dropout: their first losses compare exactly. One global batch holds all eight pairs, so neither row
order nor the layout may change step 1's loss.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests._cli import losses, ok, recipe, run_default_path, train


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_KEYS = {"v_head.summary.weight", "v_head.summary.bias"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reward_model(assets, tmp_path_factory):
    """(the tiny model with a value head, LLaMA-Factory's default path's step-1 loss on the eight pairs)."""
    root = tmp_path_factory.mktemp("rm")
    model = str(root / "model")
    shutil.copytree(assets["models"]["qwen3"], model)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["summary_dropout_prob"] = 0.0  # trl reads it from the model's config
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    weight = 0.3 * torch.randn(1, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    save_file({"v_head.summary.weight": weight, "v_head.summary.bias": torch.tensor([0.1])},
              os.path.join(model, "value_head.safetensors"), metadata={"format": "pt"})
    default = run_default_path(root, _rm_recipe(assets, model, root / "default", max_steps=1))
    assert set(load_file(str(default / "value_head.safetensors"))) == HEAD_KEYS
    return model, losses(default)[1]


def _rm_recipe(assets, model, out, **overrides):
    return recipe(assets, out, **{**dict(model_name_or_path=model, stage="rm", dataset="tiny_alpaca",
                                         dataset_dir=assets["dpo"], max_samples=8, learning_rate=3e-3), **overrides})


def _head(folder) -> dict:
    tensors = load_file(os.path.join(folder, "value_head.safetensors"))
    assert set(tensors) == HEAD_KEYS, sorted(tensors)
    return tensors


def _merge(checkpoint, output) -> None:
    merge = [sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path", str(checkpoint),
             "--output_path", str(output)]
    result = subprocess.run(merge, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_rm_first_loss_is_llamafactorys_and_its_head_is_exported(reward_model, assets, tmp_path):
    """One process, packed: step 1's loss is LLaMA-Factory's default path's (padded), the loss falls, the reward
    accuracy reaches trainer_log.jsonl, and the trained head is written beside the exported weights and the merged
    checkpoint as LLaMA-Factory writes it (value_head.safetensors, trl's keys), the same tensors both ways."""
    model, theirs = reward_model
    config = _rm_recipe(assets, model, tmp_path / "out", max_steps=4, sequence_packing=True, save_strategy="steps",
                        save_steps=4)
    result, output = train(tmp_path, config)
    ok(result, output)
    ours = losses(tmp_path / "out")
    assert abs(ours[1] - theirs) <= 1e-4 * theirs, (ours[1], theirs)
    assert ours[4] < ours[1], ours
    assert "loss: -logsigmoid(chosen - rejected) over the value head's scores (no logits)" in output
    with open(tmp_path / "out" / "trainer_log.jsonl") as f:
        assert all(0.0 <= json.loads(line)["accuracy"] <= 1.0 for line in f)
    exported = _head(tmp_path / "out")
    assert not torch.equal(exported["v_head.summary.weight"], _head(model)["v_head.summary.weight"])  # trained
    _merge(tmp_path / "out" / "checkpoint-4", tmp_path / "merged")
    merged = _head(tmp_path / "merged")
    assert all(torch.equal(exported[k], merged[k]) for k in HEAD_KEYS)


@pytest.mark.parametrize("layout", [
    # the head replicated on both TP ranks, its input gathered from the sequence-parallel halves; padded rows
    dict(tensor_model_parallel_size=2, sequence_parallel=True),
    # the head on the last stage only; packed; its checkpoint (written by that stage) merges with the head, and the
    # run resumed from step 2 on one process (no pipeline) logs step 3's loss as the PP2 run did
    dict(pipeline_model_parallel_size=2, sequence_packing=True, save_strategy="steps", save_steps=2, max_steps=3),
    # LoRA: the adapters and the whole head train; the head is saved beside the peft adapter
    dict(finetuning_type="lora", lora_target="all", lora_rank=4, learning_rate=1e-2),
    # freeze: the last layer and the whole head train
    dict(finetuning_type="freeze", freeze_trainable_layers=1),
    # context parallel: each sequence split over two ranks, its last token's score read where that token lives
    dict(context_parallel_size=2, sequence_packing=True),
], ids=["tp2_sp", "pp2_resumed_on_one", "dp2_lora", "dp2_freeze", "cp2"])
def test_rm_layouts_start_from_llamafactorys_loss(layout, reward_model, assets, tmp_path):
    """Two processes in each layout (dp 2 where nothing else splits the model): step 1's loss is LLaMA-Factory's (a
    zero-initialised LoRA adapter changes nothing yet), and the loss falls."""
    model, theirs = reward_model
    config = _rm_recipe(assets, model, tmp_path / "out", **{"max_steps": 2, **layout})
    if "finetuning_type" in layout:
        config["gradient_accumulation_steps"] = 2  # dp 2 x micro batch 2 x 2 = the eight pairs
    result, output = train(tmp_path, config, world=2)
    ok(result, output)
    ours = losses(tmp_path / "out")
    assert abs(ours[1] - theirs) <= 1e-4 * theirs, (ours[1], theirs)
    assert ours[2] < ours[1], ours
    _head(tmp_path / "out")
    if "finetuning_type" in layout:
        assert not torch.equal(_head(tmp_path / "out")["v_head.summary.weight"], _head(model)["v_head.summary.weight"])
    if layout.get("finetuning_type") == "lora":
        assert os.path.isfile(tmp_path / "out" / "adapter_model.safetensors")
    if "save_steps" in layout:
        _merge(tmp_path / "out" / "checkpoint-3", tmp_path / "merged")
        assert all(torch.equal(_head(tmp_path / "out")[k], _head(tmp_path / "merged")[k]) for k in HEAD_KEYS)
        resumed = _rm_recipe(assets, model, tmp_path / "resumed", max_steps=3, sequence_packing=True,
                             resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
        result, output = train(tmp_path, resumed, name="resumed")
        ok(result, output)
        again = losses(tmp_path / "resumed")
        assert again[3] == pytest.approx(ours[3], rel=1e-4), (again, ours)
