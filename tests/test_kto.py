"""``stage: kto`` through the real command: LLaMA-Factory's KTO (trl's loss) on the Megatron path.

Eight rows, five tagged desirable and three not, are one global batch: both steps see the same rows, so row order
cannot change a loss. The KL estimate is a micro-batch's (over the data-parallel ranks), as in LLaMA-Factory, so
every layout here holds the eight rows in one micro-batch per rank, as LLaMA-Factory's run holds them in one. Step 1
is (5 x 0.5 + 3 x 1.5 x 0.5) / 8 wherever the policy is its reference; step 2 is the first to depend on an update,
the KL estimate and the weights; both must be LLaMA-Factory's default path's.
"""

import json

import pytest
import torch

from llamafactory_mca.tools.tiny import write_alpaca_dataset
from tests._cli import default_path_losses, losses, ok, recipe, train


pytestmark = pytest.mark.slow
KTO = dict(stage="kto", dataset="tiny_alpaca", max_samples=8, per_device_train_batch_size=8,
           gradient_accumulation_steps=1, max_steps=2, learning_rate=3e-3, pref_beta=0.2, kto_rejected_weight=1.5)
LORA = dict(finetuning_type="lora", lora_target="all", lora_rank=4, learning_rate=1e-2)


def _random_adapter(model: str, folder) -> str:
    """A peft adapter with both matrices random: continuing it, the policy starts away from its reference (the base
    with the adapter off), and both paths start from the same adapter (a new one's A is drawn differently)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def kto(assets, tmp_path_factory):
    """(the data folder, per model kind the recipe's overrides and LLaMA-Factory's default path's two losses)."""
    root = tmp_path_factory.mktemp("kto")
    data = write_alpaca_dataset(str(root / "data"), 24, feedback=True)
    kinds = {"full": {},
             "lora": dict(LORA, adapter_name_or_path=_random_adapter(assets["models"]["qwen3"], root / "adapter"))}
    theirs = {kind: default_path_losses(root, recipe(assets, root, dataset_dir=data, **{**KTO, **extra}), kind)
              for kind, extra in kinds.items()}
    return data, kinds, theirs


@pytest.mark.parametrize("kind,layout", [
    # each sequence split over two ranks, packed: its log-probs summed over both; the plots LLaMA-Factory draws
    ("full", dict(context_parallel_size=2, sequence_packing=True, plot_loss=True)),
    # the loss on the last stage only, padded
    ("full", dict(pipeline_model_parallel_size=2)),
    # two ranks' micro-batches of four make the KL estimate together; the reference is the base, adapter off
    ("lora", dict(per_device_train_batch_size=4)),
], ids=["cp2_packed", "pp2", "dp2_lora"])
def test_kto_first_two_losses_are_llamafactorys(kind, layout, kto, assets, tmp_path):
    data, kinds, theirs = kto
    config = recipe(assets, tmp_path / "out", dataset_dir=data, **{**KTO, **kinds[kind], **layout})
    result, output = train(tmp_path, config, world=2)
    ok(result, output)
    ours = losses(tmp_path / "out")
    assert sorted(ours) == [1, 2] and all(ours[k] == pytest.approx(theirs[kind][k], rel=1e-4) for k in (1, 2)), \
        (ours, theirs[kind])
    assert ours[2] < ours[1], ours
    assert "data (feedback): 8 rows, 8 kept" in output and "one preference type" not in output
    if kind == "full":
        assert ours[1] == pytest.approx((5 * 0.5 + 3 * 1.5 * 0.5) / 8, rel=1e-6)
    with open(tmp_path / "out" / "trainer_state.json") as f:
        second = [entry for entry in json.load(f)["log_history"] if "loss" in entry][1]
    assert second["kl"] >= 0 and second["rewards/chosen"] > second["rewards/rejected"], second
    assert second["rewards/margins"] == pytest.approx(second["rewards/chosen"] - second["rewards/rejected"])
    assert second["logps/chosen"] < 0 and second["logps/rejected"] < 0, second
    if layout.get("plot_loss"):
        assert (tmp_path / "out" / "training_loss.png").is_file()
        assert (tmp_path / "out" / "training_rewards_chosen.png").is_file()
    if kind == "lora":
        assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
