"""A training checkpoint resumes under any layout, through the real command: one uninterrupted run is the reference,
and a chain of runs, each resuming the previous one's checkpoint under another layout, must train the same steps with
the same losses (fp32 on CPU, the same padded rows in every layout: equal to 1e-4).

The chain changes, one link at a time: PP2 (the plain optimizer) -> TP2 (the distributed optimizer: model space into
its buckets), TP2 -> TP2 x DP2, TP2 x DP2 -> PP2, PP2 -> PP2 x VPP2, PP2 x VPP2 -> PP2, PP2 -> CP2 with the plain
optimizer again (the buckets read back in model space). The MoE model: EP2 -> EP1 -> TP2 x ETP2; gpt-oss (sinks,
biased experts): EP2 -> TP2 -> PP2; Gemma 4 (layers of two shapes): TP2 -> PP2. LoRA: TP2 -> PP2
(the adapters' optimizer state). What cannot continue the same run (another stage, LoRA <-> full, another model) is
one line before any worker starts, and a checkpoint of an earlier version under another layout names the change and
the way out.
"""

import json
import os

import pytest
import torch

from tests._cli import losses, ok, one_error, recipe, train


pytestmark = pytest.mark.slow

DIST = dict(use_distributed_optimizer=True, save_strategy="steps", save_steps=2, include_num_input_tokens_seen=True)


def _run(tmp_path, assets, name, world, steps, resume=None, **overrides):
    """A run of ``steps`` steps in its own output_dir; global batch 8 rows (micro-batch 2 x dp x accumulation)."""
    config = recipe(assets, tmp_path / name, max_steps=steps, **{**DIST, **overrides})
    if resume is not None:
        config["resume_from_checkpoint"] = str(resume)
    result, output = train(tmp_path, config, world=world, name=name)
    return result, output


def _same_losses(reference: dict, got: dict, steps) -> None:
    for step in steps:
        assert got[step] == pytest.approx(reference[step], rel=1e-4), (step, got, reference)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted run: PP2 with the plain optimizer (its state in model space), 14 steps, a checkpoint
    every 2."""
    tmp_path = tmp_path_factory.mktemp("reference")
    result, output = _run(tmp_path, assets, "ref", 2, 14, pipeline_model_parallel_size=2,
                          gradient_accumulation_steps=4, use_distributed_optimizer=False)
    ok(result, output)
    return tmp_path / "ref", losses(tmp_path / "ref")


# (name, resumes from (link or "ref"), at step, world, layout keys, the change the resume line names); the
# distributed optimizer is on from the first link (model space into its buckets) to the last (out of them)
CHAIN = [
    ("tp2", "ref", 2, 2, dict(tensor_model_parallel_size=2, gradient_accumulation_steps=4),
     "tensor_model_parallel_size 1 -> 2, pipeline_model_parallel_size 2 -> 1"),
    ("tp2-dp2", "tp2", 4, 4, dict(tensor_model_parallel_size=2, gradient_accumulation_steps=2),
     "data_parallel_size 1 -> 2"),
    ("pp2", "tp2-dp2", 6, 2, dict(pipeline_model_parallel_size=2, gradient_accumulation_steps=4),
     "tensor_model_parallel_size 2 -> 1, pipeline_model_parallel_size 1 -> 2, data_parallel_size 2 -> 1"),
    ("vpp2", "pp2", 8, 2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                               gradient_accumulation_steps=4),
     "virtual_pipeline_model_parallel_size 1 -> 2"),
    ("pp2-again", "vpp2", 10, 2, dict(pipeline_model_parallel_size=2, gradient_accumulation_steps=4),
     "virtual_pipeline_model_parallel_size 2 -> 1"),
    ("cp2-plain-optimizer", "pp2-again", 12, 2, dict(context_parallel_size=2, gradient_accumulation_steps=4,
                                                     use_distributed_optimizer=False),
     "pipeline_model_parallel_size 2 -> 1, context_parallel_size 1 -> 2"),
]


@pytest.fixture(scope="module")
def chain(assets, reference, tmp_path_factory):
    """Each link resumes the previous one's checkpoint and trains two steps (run in order, once)."""
    tmp_path = tmp_path_factory.mktemp("chain")
    folders = {"ref": reference[0]}
    runs = {}
    for name, source, step, world, layout, _ in CHAIN:
        resume = folders[source] / f"checkpoint-{step}"
        runs[name] = _run(tmp_path, assets, name, world, step + 2, resume=resume, **layout)
        folders[name] = tmp_path / name
    return folders, runs


@pytest.mark.parametrize("link", CHAIN, ids=[link[0] for link in CHAIN])
def test_a_resume_under_another_layout_trains_the_same_steps(link, reference, chain):
    name, source, step, _, _, change = link
    folders, runs = chain
    result, output = runs[name]
    ok(result, output)
    checkpoint = folders[source] / f"checkpoint-{step}"
    assert f"Resuming {checkpoint} under another layout ({change})" in output, output[-3000:]
    assert f"Resumed from {checkpoint} at step {step}" in output
    _same_losses(reference[1], losses(folders[name]), (step + 1, step + 2))
    with open(folders[name] / "trainer_state.json") as f, \
            open(reference[0] / f"checkpoint-{step + 2}" / "trainer_state.json") as g:
        assert json.load(f)["num_input_tokens_seen"] == json.load(g)["num_input_tokens_seen"]  # the data position


def test_moe_resumes_from_ep2_to_ep1_and_to_tp2_with_expert_tensor_parallelism(assets, tmp_path):
    # grouped experts: one parameter per layer for all of a rank's experts, stored per expert through a factory
    moe = dict(model_name_or_path=assets["models"]["qwen3_moe"], moe_grouped_gemm=True)
    result, output = _run(tmp_path, assets, "ep2", 2, 6, expert_model_parallel_size=2, gradient_accumulation_steps=2,
                          **moe)
    ok(result, output)
    expected = losses(tmp_path / "ep2")
    result, output = _run(tmp_path, assets, "ep1", 1, 4, resume=tmp_path / "ep2" / "checkpoint-2",
                          gradient_accumulation_steps=4, **moe)
    ok(result, output)
    assert "(expert_model_parallel_size 2 -> 1, data_parallel_size 2 -> 1)" in output
    _same_losses(expected, losses(tmp_path / "ep1"), (3, 4))
    result, output = _run(tmp_path, assets, "etp2", 2, 6, resume=tmp_path / "ep1" / "checkpoint-4",
                          tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2,
                          gradient_accumulation_steps=4, **moe)
    ok(result, output)
    assert "tensor_model_parallel_size 1 -> 2, expert_tensor_parallel_size 1 -> 2" in output
    _same_losses(expected, losses(tmp_path / "etp2"), (5, 6))


def test_gpt_oss_resumes_from_ep2_to_tp2_and_to_pp2(assets, tmp_path):
    """gpt-oss's own state (the sinks split over TP, the grouped experts' biases with their expert axis, the router's
    bias) re-laid out with the distributed optimizer's buckets: EP2 -> TP2 + SP -> PP2 train the same steps. Under TP2
    each rank's copy of every expert sees half the tokens: step 4 differed by 2e-4 while those halves were not summed
    (the expert-data-parallel group, ``models/auto.py``)."""
    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model("gpt_oss", str(tmp_path / "gpt_oss"), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    result, output = _run(tmp_path, assets, "ep2", 2, 6, expert_model_parallel_size=2, gradient_accumulation_steps=2,
                          model_name_or_path=model)
    ok(result, output)
    expected = losses(tmp_path / "ep2")
    result, output = _run(tmp_path, assets, "tp2", 2, 4, resume=tmp_path / "ep2" / "checkpoint-2",
                          tensor_model_parallel_size=2, sequence_parallel=True, gradient_accumulation_steps=4,
                          model_name_or_path=model)
    ok(result, output)
    assert "(tensor_model_parallel_size 1 -> 2, expert_model_parallel_size 2 -> 1" in output, output[-3000:]
    _same_losses(expected, losses(tmp_path / "tp2"), (3, 4))
    result, output = _run(tmp_path, assets, "pp2", 2, 6, resume=tmp_path / "tp2" / "checkpoint-4",
                          pipeline_model_parallel_size=2, gradient_accumulation_steps=4, model_name_or_path=model)
    ok(result, output)
    _same_losses(expected, losses(tmp_path / "pp2"), (5, 6))


@pytest.mark.parametrize("family,second,change", [
    ("gemma4_text", dict(pipeline_model_parallel_size=2, gradient_accumulation_steps=4),
     "tensor_model_parallel_size 2 -> 1, pipeline_model_parallel_size 1 -> 2"),
    ("gemma4_text_e2b", dict(gradient_accumulation_steps=2), "tensor_model_parallel_size 2 -> 1")])
def test_gemma4_resumes_from_tp2_under_another_layout(family, second, change, assets, tmp_path):
    """Gemma 4's full-attention layers (their own head sizes, checkpointed per layer; q and k only where the keys are
    the values) and its frozen layer scalars, with the distributed optimizer's buckets: TP2 + SP -> PP2 trains the
    same steps. The E2B's layout (per-layer inputs: a second embedding whole on every TP rank, the model's projection
    split over them, each layer's gate and projection; layers without keys or values and their double-wide MLPs,
    which keep it on one stage): TP2 + SP -> DP2."""
    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model(family, str(tmp_path / family), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    result, output = _run(tmp_path, assets, "tp2", 2, 4, tensor_model_parallel_size=2, sequence_parallel=True,
                          gradient_accumulation_steps=4, model_name_or_path=model)
    ok(result, output)
    expected = losses(tmp_path / "tp2")
    result, output = _run(tmp_path, assets, "second", 2, 4, resume=tmp_path / "tp2" / "checkpoint-2",
                          model_name_or_path=model, **second)
    ok(result, output)
    assert change in output, output[-3000:]
    _same_losses(expected, losses(tmp_path / "second"), (3, 4))


def test_lora_resumes_from_tp2_to_pp2(assets, tmp_path):
    lora = dict(finetuning_type="lora", lora_rank=4, lora_target="all", learning_rate=1e-2)
    result, output = _run(tmp_path, assets, "lora-tp2", 2, 4, tensor_model_parallel_size=2,
                          gradient_accumulation_steps=4, **lora)
    ok(result, output)
    result, output = _run(tmp_path, assets, "lora-pp2", 2, 4, resume=tmp_path / "lora-tp2" / "checkpoint-2",
                          pipeline_model_parallel_size=2, gradient_accumulation_steps=4, **lora)
    ok(result, output)
    assert "under another layout (tensor_model_parallel_size 2 -> 1, pipeline_model_parallel_size 1 -> 2)" in output
    _same_losses(losses(tmp_path / "lora-tp2"), losses(tmp_path / "lora-pp2"), (3, 4))


@pytest.mark.parametrize("overrides,fragments", [
    (dict(stage="dpo"), ("was written by a stage='sft' run and this run has stage='dpo'",
                         "set model_name_or_path: ")),
    (dict(finetuning_type="lora"), ("was written by a finetuning_type='full' run and this run has "
                                    "finetuning_type='lora'",)),
    ("qwen3_moe", ("it was written for qwen3 (", "and this run trains qwen3_moe (")),
], ids=["stage", "full-to-lora", "model"])
def test_what_would_not_continue_the_same_run_is_one_line(overrides, fragments, assets, reference, tmp_path):
    if overrides == "qwen3_moe":
        overrides = dict(model_name_or_path=assets["models"]["qwen3_moe"])
    if overrides.get("stage") == "dpo":
        overrides["dataset_dir"] = assets["dpo"]
    config = recipe(assets, tmp_path / "out", max_steps=4, resume_from_checkpoint=str(reference[0] / "checkpoint-2"),
                    **overrides)
    result, output = train(tmp_path, config, world=1, alone=False)
    message = one_error(result, output, "cannot resume from", *fragments)
    assert result.seconds < 60, message  # the launcher's check: no worker started
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_an_earlier_versions_checkpoint_under_another_layout_names_the_change(assets, chain, tmp_path):
    """Distributed-optimizer checkpoints written before the bucket map reload under their own layout only: one line
    says so."""
    import shutil

    old = tmp_path / "old" / "checkpoint-4"
    shutil.copytree(chain[0]["tp2"] / "checkpoint-4", old)  # TP2, the distributed optimizer
    common = old / "dist_ckpt" / "common.pt"
    state = torch.load(common, weights_only=False)
    for key in ("bucket_map", "optimizer_format"):
        state["trainer"].pop(key)
    torch.save(state, common)
    os.remove(old / "mca_manifest.json")  # those versions wrote no checksums either
    config = recipe(assets, tmp_path / "out", max_steps=6, resume_from_checkpoint=str(old), **DIST,
                    pipeline_model_parallel_size=2)
    result, output = train(tmp_path, config, world=2)
    one_error(result, output, f"{old} was written by an earlier llamafactory_mca",
              "this run changes it (tensor_model_parallel_size 2 -> 1, pipeline_model_parallel_size 1 -> 2)",
              f"model_name_or_path: {old}")
