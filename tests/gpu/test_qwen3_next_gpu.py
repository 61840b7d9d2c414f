"""Qwen3-Next's gated delta-rule layers on one CUDA GPU: the kernel the layer picks there (flash-linear-attention in
bf16, packed with ``cu_seqlens`` and grouped value heads, where it is correct; else our torch rule, delta_rule.py)
against transformers' torch chunked rule run per sequence in fp32, outputs and gradients; and the tiny model through
the real command in bf16, packed, with the optimizer offloaded to the CPU; tiny Qwen3.5 and Qwen3.5-MoE (the same
layers under a vision tower, and its multi-token-prediction layer) through the real command in bf16, packed, with
images and videos.
"""

import json
import math

import pytest
import torch

from tests._cli import losses, ok, recipe, train
from tests.models._bridge import hf_tensors
from tests.models._delta_rule import transformers_rule_per_sequence


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LENGTHS = (1, 37, 64, 200, 3, 130)  # a single token, chunk-sized, ragged


def _inputs(nk=2, nv=4, dk=64, dv=96):
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q, k = rand(1, total, nk, dk).bfloat16(), rand(1, total, nk, dk).bfloat16()
    v = rand(1, total, nv, dv).bfloat16()
    decay = -torch.nn.functional.softplus(rand(1, total, nv))  # log-space decay, fp32 as the layer gives it
    beta = rand(1, total, nv).sigmoid().bfloat16()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda")
    return q, k, v, decay, beta, cu


def test_delta_rule_on_the_gpu_equals_the_torch_rule_per_sequence():
    """Whichever kernel this GPU runs (fla where it is correct, else our torch rule, delta_rule.py)."""
    from llamafactory_mca.models.native.gated_delta import delta_rule

    q, k, v, decay, beta, cu = _inputs()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ours = delta_rule(*leaves, decay, beta, cu)
    ours.float().square().sum().backward()
    ref_leaves = [t.float().clone().requires_grad_(True) for t in (q, k, v)]
    want = transformers_rule_per_sequence(*ref_leaves, decay, beta, cu.tolist())
    want.square().sum().backward()

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    assert rel(ours, want) < 2e-2, rel(ours, want)
    for mine, theirs, name in zip(leaves, ref_leaves, "qkv"):
        assert rel(mine.grad, theirs.grad) < 3e-2, (name, rel(mine.grad, theirs.grad))


def test_qwen3_next_trains_packed_in_bf16_with_the_optimizer_on_the_cpu(assets, tmp_path):
    from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model("qwen3_next", str(tmp_path / "qwen3_next"), vocab_size=assets["vocab"])
    save_tiny_tokenizer(model)
    config = recipe(assets, tmp_path / "out", model_name_or_path=model, bf16=True, sequence_packing=True,
                    max_steps=8, learning_rate=3e-3, use_distributed_optimizer=True, optimizer_cpu_offload=True)
    result, output = train(tmp_path, config, gpu=True)
    ok(result, output)
    from llamafactory_mca.models.native.gated_delta import describe_kernel

    assert f"gated delta rule: {describe_kernel()}" in output and "CPU offload" in output, output[-3000:]
    curve = losses(tmp_path / "out")
    assert len(curve) == 8 and curve[8] < curve[1], curve


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_trains_packed_with_images_in_bf16(family, tmp_path):
    from llamafactory_mca.tools.tiny import save_tiny_vl_model, write_image_dataset

    model = save_tiny_vl_model(family, str(tmp_path / "model"))
    data = write_image_dataset(str(tmp_path), 12, video_every=3)
    config = recipe({"models": {"qwen3": model}, "sft": data}, tmp_path / "out", dataset="tiny_images",
                    template="qwen3_5", cutoff_len=256, image_max_pixels=768, image_min_pixels=256, bf16=True,
                    sequence_packing=True, per_device_train_batch_size=4, gradient_accumulation_steps=3, max_steps=6,
                    learning_rate=3e-3, save_strategy="steps", save_steps=6)
    result, output = train(tmp_path, config, gpu=True)
    ok(result, output)
    curve = losses(tmp_path / "out")
    assert len(curve) == 6 and curve[6] < curve[1], curve
    with open(tmp_path / "out" / "checkpoint-6" / "trainer_state.json") as f:  # the MTP layer, on image features
        mtp = [entry["mtp_loss"] for entry in json.load(f)["log_history"] if "mtp_loss" in entry]
    assert len(mtp) == 6 and all(map(math.isfinite, mtp)) and mtp[-1] < mtp[0], mtp
    before, after = hf_tensors(model), hf_tensors(tmp_path / "out")
    tower = [k for k in before if "visual." in k]  # frozen; the export is in the run's dtype (bf16)
    assert tower and all(torch.equal(before[k].to(after[k].dtype), after[k]) for k in tower)
    assert not torch.equal(before["mtp.fc.weight"].to(after["mtp.fc.weight"].dtype), after["mtp.fc.weight"])
