"""The data side of vision-language models checks, on the host, that placeholder tokens and vision features pair up
(the model then fills one with the other without a device-to-host count)."""

from types import SimpleNamespace

import pytest
import torch

from llamafactory_mca.data.multimodal import VisionInputs, image_blocks
from llamafactory_mca.models.families import get_family
from llamafactory_mca.tools.tiny import tiny_hf_config


def _inputs(family: str, video_span: tuple[int, int] | None = None) -> VisionInputs:
    """Built from the tiny model's config, as the workflow builds it (no plugin or processor: counts only)."""
    return VisionInputs(None, None, tiny_hf_config(family).to_dict(), video_span=video_span,
                        projector=get_family(family).vision.projector)


def test_placeholders_and_features_must_pair_up():
    vision = _inputs("qwen2_vl")  # image 196, video 197, patches merged 2 x 2
    image, video = 196, 197
    grid = {"image_grid_thw": torch.tensor([[1, 4, 4]]), "video_grid_thw": torch.tensor([[2, 2, 4]])}
    tokens = torch.tensor([[1] * 3 + [image] * 4 + [video] * 4 + [2]])  # 4 image tokens (16 patches / 4), 4 video
    vision._check_counts(SimpleNamespace(tokens=tokens), grid)
    vision._check_counts(SimpleNamespace(tokens=torch.tensor([[1, 2, 3]])), {})  # text only
    with pytest.raises(ValueError, match=r"3 placeholder tokens but 4 vision features \(image_grid_thw\)"):
        vision._check_counts(SimpleNamespace(tokens=torch.tensor([[image] * 3 + [video] * 4])), grid)
    with pytest.raises(ValueError, match=r"4 placeholder tokens but 0 vision features \(video_grid_thw\)"):
        vision._check_counts(SimpleNamespace(tokens=tokens), {"image_grid_thw": grid["image_grid_thw"]})
    # GLM-4.5V: a video's frames are image tokens between the video's begin (198) and end (199) ids
    vision = _inputs("glm4v_moe", video_span=(198, 199))
    glm = torch.tensor([[1] + [image] * 4 + [198] + [image] * 2 + [3] + [image] * 2 + [199] + [2]])
    vision._check_counts(SimpleNamespace(tokens=glm), grid)
    with pytest.raises(ValueError, match=r"4 placeholder tokens but 0 vision features \(video_grid_thw\)"):
        vision._check_counts(SimpleNamespace(tokens=glm), {"image_grid_thw": grid["image_grid_thw"]})  # frames: video


def test_gemma3_images_are_whole_and_see_each_other():
    """Gemma 3: every image is mm_tokens_per_image (4) tokens whatever its pixels, with plain positions; each run of
    image tokens is one block for the attention, a second image right after text a new one."""
    vision = _inputs("gemma3")
    image = 196
    tokens = torch.tensor([[1, 192] + [image] * 4 + [193, 5, 192] + [image] * 4 + [193]])
    two = {"pixel_values": torch.zeros(2, 3, 16, 16)}
    vision._check_counts(SimpleNamespace(tokens=tokens), two)
    with pytest.raises(ValueError, match=r"8 placeholder tokens but 4 vision features"):
        vision._check_counts(SimpleNamespace(tokens=tokens), {"pixel_values": torch.zeros(1, 3, 16, 16)})
    assert image_blocks(tokens, image).tolist() == [[-1, -1, 0, 0, 0, 0, -1, -1, -1, 1, 1, 1, 1, -1]]
    # two rows: blocks count per row
    rows = torch.tensor([[image, image, 1, image], [1, image, image, 2]])
    assert image_blocks(rows, image).tolist() == [[0, 0, -1, 1], [-1, 0, 0, -1]]


def test_internvl_tiles_are_image_seq_length_tokens_each():
    """InternVL: every tile (pixel_values row) is image_seq_length (4) tokens; a two-tile image and a one-tile image
    are three tiles' tokens (LLaMA-Factory's plugin writes them between <img> and </img>)."""
    vision = _inputs("internvl")
    image = 196
    tokens = torch.tensor([[1] + [image] * 8 + [5] + [image] * 4 + [2]])
    vision._check_counts(SimpleNamespace(tokens=tokens), {"pixel_values": torch.zeros(3, 3, 16, 16)})
    with pytest.raises(ValueError, match=r"12 placeholder tokens but 8 vision features"):
        vision._check_counts(SimpleNamespace(tokens=tokens), {"pixel_values": torch.zeros(2, 3, 16, 16)})
    # videos: LLaMA-Factory's plugin gives a batch's frames after all of its images, out of the placeholders' order
    sample = SimpleNamespace(sequences=[[1]], images=["a.png"], videos=[["f0.png", "f1.png"]])
    with pytest.raises(ValueError, match=r"1 video\(s\) in a micro-batch .* videos are not supported there"):
        vision.attach(SimpleNamespace(packed=True), [sample])


def test_gemma4_images_are_their_valid_patches_pooled():
    """Gemma 4: each image its own count of tokens, its valid patches (positions not (-1, -1), the processor's
    padding) pooled 2 x 2; a row with a video is refused as for the other LLaVA-layout models."""
    vision = _inputs("gemma4")
    image = tiny_hf_config("gemma4").image_token_id
    # an image of 4 x 4 patches (4 tokens) and one of 4 x 2 (2 tokens), each padded to 20 patches
    grids = [torch.stack(torch.meshgrid(torch.arange(w), torch.arange(4), indexing="xy"), -1).reshape(-1, 2)
             for w in (4, 2)]
    positions = torch.stack([torch.cat([g, torch.full((20 - len(g), 2), -1)]) for g in grids])
    tokens = torch.tensor([[1] + [image] * 4 + [5] + [image] * 2 + [2]])
    vision._check_counts(SimpleNamespace(tokens=tokens), {"image_position_ids": positions})
    with pytest.raises(ValueError, match=r"6 placeholder tokens but 4 vision features"):
        vision._check_counts(SimpleNamespace(tokens=tokens), {"image_position_ids": positions[:1]})
    sample = SimpleNamespace(sequences=[[1]], images=[], videos=[["f0.png", "f1.png"]])
    with pytest.raises(ValueError, match=r"1 video\(s\) in a micro-batch of gemma4 .* videos are not supported there"):
        vision.attach(SimpleNamespace(packed=True), [sample])
