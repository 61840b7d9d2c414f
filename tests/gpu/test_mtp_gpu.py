"""Multi-token prediction on one CUDA GPU through the real command: DeepSeek-V3's and GLM-4.5's tiny models with their
MTP layer, bf16, packed sequences (the sync-free packed roll, varlen attention, grouped experts), the MTP loss logged
and falling, and the merge writing the trained layer back.

Run: ``python -m pytest tests/gpu/test_mtp_gpu.py -q`` (skipped without CUDA).
"""

import json
import os

import pytest
import torch

from tests._cli import losses, ok, recipe, train


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_trains_packed_in_bf16(family, assets, tmp_path):
    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model(family, str(tmp_path / family), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    config = recipe(assets, tmp_path / "out", model_name_or_path=model, bf16=True, packing=True, max_steps=8,
                    learning_rate=3e-3, save_strategy="steps", save_steps=8, save_hf_model=True)
    result, output = train(tmp_path, config, gpu=True)
    ok(result, output)
    curve = losses(tmp_path / "out")
    with open(tmp_path / "out" / "checkpoint-8" / "trainer_state.json") as f:  # trainer_log.jsonl keeps LF's keys
        mtp = [entry["mtp_loss"] for entry in json.load(f)["log_history"] if "mtp_loss" in entry]
    assert len(mtp) == 8 and all(map(torch.isfinite, torch.tensor(mtp))), mtp
    assert mtp[-1] < mtp[0] and curve[8] < curve[1], (mtp, curve)
    from safetensors import safe_open

    hf = tmp_path / "out" / "checkpoint-8" / "hf"
    keys = {k for f in os.listdir(hf) if f.endswith(".safetensors") for k in safe_open(str(hf / f), "pt").keys()}
    assert "model.layers.4.eh_proj.weight" in keys and "model.layers.4.shared_head.head.weight" in keys
