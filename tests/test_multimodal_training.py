"""Vision-language sft through ``USE_MCA=1 llamafactory-cli train``, against LLaMA-Factory's default path on the same
rows with images (and, for Qwen3-VL and Qwen3.5, videos), resized by ``image_max_pixels``: the first step's loss (the
global batch is the whole set, so row order cannot matter) at PP2 (the tower on the first stage, with Qwen3-VL's
deepstack layers), padded for Qwen2-VL and packed for Qwen3-VL; Qwen3.5 packed at TP2 + SP (gated delta-rule layers
restarting per sequence, and its multi-token-prediction layer trained on the image features); GLM-4.5V packed at
EP2 with images; Gemma 3 packed at PP2 (image tokens that see their whole image, on both stages); InternVL packed at
TP2 + SP, and over gpt-oss's decoder at EP2 (its sinks and windows on packed rows); Gemma 4 packed at PP2 (images of
their own sizes, seeing themselves on the windowed layers); the tower frozen as LLaMA-Factory freezes it by default;
the export loading into ``transformers``.
(Packed PP4 and PP2 x EP4: the recipes in tests/test_examples.py.)"""

import pytest
import torch

from llamafactory_mca.tools.tiny import model_type_of, save_tiny_vl_model, write_image_dataset
from tests._cli import default_path_losses, losses, ok, recipe, train
from tests.models._bridge import hf_tensors


pytestmark = pytest.mark.slow


PP2 = {"pipeline_model_parallel_size": 2}
TP2_SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
EP2 = {"expert_model_parallel_size": 2}


@pytest.mark.parametrize("family,template,video_every,packing,layout", [
    ("qwen2_vl", "qwen2_vl", 0, False, PP2), ("qwen3_vl", "qwen3_vl", 3, True, PP2),
    # Qwen3.5 trains its multi-token-prediction layer, which sees the image features: not under pipelining
    ("qwen3_5", "qwen3_5", 3, True, TP2_SP),
    # GLM-4.5V, images only: LLaMA-Factory 0.9.5's glm4v plugin calls transformers 5.6's video processor with an
    # argument it no longer takes, on either path (videos: tests/models/test_multimodal.py)
    ("glm4v_moe", "glm4_5v", 0, True, EP2),
    # Gemma 3: a pack's image tokens see their whole image, on the later stage too (it has the tokens, not the pixels)
    ("gemma3", "gemma3", 0, True, PP2),
    # InternVL: the tower replicated over TP ranks, its features scattered over SP ranks
    ("internvl", "intern_vl", 0, True, TP2_SP),
    # InternVL 3.5 GPT-OSS: the same tower over gpt-oss's decoder, its experts split over the ranks
    ("internvl_gpt_oss", "intern_vl", 0, True, EP2),
    # Gemma 4: images of their own sizes (up to 70 tokens each), whose tokens see one another on the windowed layers
    ("gemma4", "gemma4", 0, True, PP2)])
def test_vision_language_sft_matches_llamafactory_and_keeps_the_tower_frozen(tmp_path, family, template, video_every,
                                                                            packing, layout):
    from llamafactory.model.model_utils.visual import COMPOSITE_MODELS
    from transformers import AutoConfig, AutoModelForImageTextToText

    model = save_tiny_vl_model(family, str(tmp_path / "model"))
    # one or two images a row, two image sizes; for Qwen3-VL every third row also has a two-frame video
    data = write_image_dataset(str(tmp_path), 12, video_every=video_every)
    assets = {"models": {"qwen3": model}, "sft": data}
    # image_max_pixels / image_min_pixels: every image (32 x 32 or 48 x 32 pixels) is scaled down, on both paths alike
    vl = dict(dataset="tiny_images", template=template, cutoff_len=256, gradient_accumulation_steps=3, max_steps=1,
              image_max_pixels=768, image_min_pixels=256, per_device_train_batch_size=4)
    if family == "gemma4":
        # transformers' Trainer averages the micro-batches' means for Gemma 4's class (accepts_loss_kwargs = False),
        # where we average the global batch's tokens: one micro-batch of all 12 rows compares them
        vl.update(cutoff_len=512, gradient_accumulation_steps=1, per_device_train_batch_size=12)
    # 4 rows a micro-batch x 3 (Gemma 4: 12 x 1): all 12 rows in the first step, on either path
    default = recipe(assets, tmp_path / "default", **vl)
    theirs = default_path_losses(tmp_path, default)[1]

    # two ranks, dp 1. PP2: the pixels go to the first stage only. Packed: positions restart per sequence in the
    # pack. Three steps: each is one epoch of the 12 rows, so the loss must fall.
    config = recipe(assets, tmp_path / "ours", **{**vl, "max_steps": 3}, **layout, sequence_packing=packing)
    result, output = train(tmp_path, config, world=2, name="ours")
    ok(result, output)
    ours = losses(tmp_path / "ours")
    assert ours[1] == pytest.approx(theirs, rel=1e-6), theirs  # the next-token loss (MTP's is logged apart)
    llava = model_type_of(family) in ("gemma3", "internvl", "gemma4")
    tower = "over a micro-batch's images" if llava else "per image or window"  # varlen_attn on GPUs
    assert f"; vision tower: SDPA {tower}" in output, output[-3000:]
    assert ("image tokens see their whole image: one SDPA call under a mask" in output) == (family == "gemma3")
    assert ("image tokens see their whole image on the windowed layers: one SDPA call" in output) == (
        family == "gemma4")
    assert ours[3] < ours[2] < ours[1], ours

    before, after = hf_tensors(model), hf_tensors(tmp_path / "ours")
    assert sorted(before) == sorted(after)
    # freeze_vision_tower and freeze_multi_modal_projector, as LLaMA-Factory names their parts: Qwen's whole tower;
    # GLM-4.5V's patch embedding, blocks and merger, while its position table, downsampling and norms train
    names = COMPOSITE_MODELS[AutoConfig.from_pretrained(model).model_type]
    frozen = [k for k in before if any(key in k for key in names.vision_model_keys + names.projector_keys)]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    trained = [k for k in before if ("visual." in k or "vision_tower." in k) and k not in frozen]
    assert (family == "glm4v_moe") == bool(trained), trained
    assert all(not torch.equal(before[k], after[k]) for k in trained if k.endswith("weight")), trained
    norm = next(k for k in before if k.endswith(("model.norm.weight", "language_model.norm.weight")))
    assert not torch.equal(before[norm], after[norm])  # the language model trained
    if family == "qwen3_5":
        assert not torch.equal(before["mtp.fc.weight"], after["mtp.fc.weight"])  # and its MTP layer
        assert "| mtp loss " in output and "with 1 multi-token-prediction layer(s)" in output, output[-3000:]
    _, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors


@pytest.mark.parametrize("family,template,stage,pref_loss,packing,layout", [
    # padded, the loss on the later stage
    ("qwen2_vl", "qwen2_vl", "dpo", "sigmoid", False, PP2),
    # ORPO has no reference, so step 1 already depends on the pixels; packed, a pair's two sequences side by side, each
    # with its own copy of the images
    ("qwen3_vl", "qwen3_vl", "dpo", "orpo", True, {}),
    # KTO: a row's KL sample (its prompt with another row's answer) holds the prompt's images too. The tiny tokenizer
    # spells the template's "model" with its unknown token, which is also its pad token: the embedding row
    # transformers never trains through lookups (padding_idx), here on sequence-parallel slices. (LLaMA-Factory
    # 0.9.5's KTO cannot run Qwen-VL models on transformers 5.6: it does not pass their mm_token_type_ids.)
    ("gemma3", "gemma3", "kto", None, True, TP2_SP),
], ids=["qwen2_vl_dpo_pp2", "qwen3_vl_orpo", "gemma3_kto_tp2_sp"])
def test_vision_language_preference_matches_llamafactory(tmp_path, family, template, stage, pref_loss, packing,
                                                         layout):
    """DPO, ORPO and KTO on rows with images, against LLaMA-Factory's default path: the eight rows are one global
    batch, both steps see them all, and steps 1 and 2 (the first after an update) must be LLaMA-Factory's."""
    model = save_tiny_vl_model(family, str(tmp_path / "model"))
    data = write_image_dataset(str(tmp_path), 8, ranking=stage == "dpo", feedback=stage == "kto")
    assets = {"models": {"qwen3": model}, "sft": data}
    vl = dict(stage=stage, dataset="tiny_images", template=template, cutoff_len=256, per_device_train_batch_size=8,
              gradient_accumulation_steps=1, max_steps=2, learning_rate=3e-3, pref_beta=0.1, image_max_pixels=768,
              image_min_pixels=256, **({"pref_loss": pref_loss} if pref_loss else {}))
    theirs = default_path_losses(tmp_path, recipe(assets, tmp_path / "default", **vl))

    config = recipe(assets, tmp_path / "ours", **vl, **layout, sequence_packing=packing)
    result, output = train(tmp_path, config, world=2 if layout else 1, name="ours")
    ok(result, output)
    ours = losses(tmp_path / "ours")
    assert sorted(ours) == [1, 2] and all(ours[k] == pytest.approx(theirs[k], rel=1e-4) for k in (1, 2)), \
        (ours, theirs)
    assert ours[2] < ours[1], ours
