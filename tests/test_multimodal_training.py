"""Vision-language sft through ``USE_MCA=1 llamafactory-cli train``, against LLaMA-Factory's default path on the same
rows with images: the first step's loss (the global batch is the whole set, so row order cannot matter), packed at
PP2 (the tower on the first stage), and the tower frozen as LLaMA-Factory freezes it by default. (Packed TP2 + SP:
the guide's recipe in tests/test_examples.py.)"""

import os

import pytest
import torch
import yaml

from llamafactory_mca.tiny import save_tiny_vl_model, write_image_dataset
from tests._cli import cli_env, losses, ok, recipe, run, train

pytestmark = pytest.mark.slow


def test_vision_language_sft_matches_llamafactory_and_keeps_the_tower_frozen(tmp_path):
    from safetensors.torch import load_file

    model = save_tiny_vl_model("qwen2_vl", str(tmp_path / "model"))
    data = write_image_dataset(str(tmp_path), 12)  # one or two images a row, two image sizes
    assets = {"models": {"qwen3": model}, "sft": data}
    vl = dict(dataset="tiny_images", template="qwen2_vl", cutoff_len=256, gradient_accumulation_steps=3, max_steps=1)
    # 4 rows a micro-batch x 3: all 12 rows in the first step, on either path
    (tmp_path / "default.yaml").write_text(yaml.safe_dump(recipe(assets, tmp_path / "default", **vl,
                                                                 per_device_train_batch_size=4)))
    env = {k: v for k, v in cli_env(None).items() if k != "USE_MCA"}
    result, output = run(["llamafactory-cli", "train", str(tmp_path / "default.yaml")], env=env, timeout=300,
                         cwd=tmp_path)
    assert result.returncode == 0, output[-4000:]
    theirs = losses(tmp_path / "default")[1]

    # PP2 (dp 1) and packed: the pixels go to the first stage only, and positions restart per sequence in the pack
    config = recipe(assets, tmp_path / "pp2", **vl, pipeline_model_parallel_size=2, sequence_packing=True,
                    per_device_train_batch_size=4)
    result, output = train(tmp_path, config, world=2, name="pp2")
    ok(result, output)
    assert losses(tmp_path / "pp2")[1] == pytest.approx(theirs, rel=1e-6), theirs

    before, after = (load_file(os.path.join(folder, "model.safetensors")) for folder in (model, tmp_path / "pp2"))
    assert sorted(before) == sorted(after)
    tower = [k for k in before if k.startswith("visual.")]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)  # freeze_vision_tower (and projector)
    assert not torch.equal(before["model.norm.weight"], after["model.norm.weight"])  # the language model trained
