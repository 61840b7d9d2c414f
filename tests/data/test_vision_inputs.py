"""The data side of vision-language models checks, on the host, that placeholder tokens and vision features pair up
(the model then fills one with the other without a device-to-host count)."""

from types import SimpleNamespace

import pytest
import torch

from llamafactory_mca.data.multimodal import VisionInputs


def _inputs() -> VisionInputs:
    vision = VisionInputs.__new__(VisionInputs)  # only the token ids and the merge size matter here
    vision.merge, vision.image_token_id, vision.video_token_id, vision.video_span = 2, 7, 8, None
    return vision


def test_placeholders_and_features_must_pair_up():
    vision = _inputs()
    grid = {"image_grid_thw": torch.tensor([[1, 4, 4]]), "video_grid_thw": torch.tensor([[2, 2, 4]])}
    tokens = torch.tensor([[1] * 3 + [7] * 4 + [8] * 4 + [2]])  # 4 image tokens (16 patches / 4), 4 video tokens
    vision._check_counts(SimpleNamespace(tokens=tokens), grid)
    vision._check_counts(SimpleNamespace(tokens=torch.tensor([[1, 2, 3]])), {})  # text only
    with pytest.raises(ValueError, match=r"3 placeholder tokens but 4 vision features \(image_grid_thw\)"):
        vision._check_counts(SimpleNamespace(tokens=torch.tensor([[7, 7, 7] + [8] * 4])), grid)
    with pytest.raises(ValueError, match=r"4 placeholder tokens but 0 vision features \(video_grid_thw\)"):
        vision._check_counts(SimpleNamespace(tokens=tokens), {"image_grid_thw": grid["image_grid_thw"]})
    # GLM-4.5V: a video's frames are image tokens between the video's begin (5) and end (6) ids
    vision.video_span = (5, 6)
    glm = torch.tensor([[1] + [7] * 4 + [5] + [7] * 2 + [3] + [7] * 2 + [6] + [2]])
    vision._check_counts(SimpleNamespace(tokens=glm), grid)
    with pytest.raises(ValueError, match=r"4 placeholder tokens but 0 vision features \(video_grid_thw\)"):
        vision._check_counts(SimpleNamespace(tokens=glm), {"image_grid_thw": grid["image_grid_thw"]})  # frames: video
