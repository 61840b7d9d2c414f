"""One row of vision-language input, the same for every test that holds our vision-language models against
transformers' (the logits and LoRA tests, the MTP loss with images): a fixed row keeps their answers comparable."""

import torch

from llamafactory_mca.data.multimodal import placeholder_types


IMAGE_GRID = torch.tensor([[1, 4, 4], [1, 4, 8]])  # two images: 4 and 8 tokens after the 2 x 2 merge
VIDEO_GRID = torch.tensor([[2, 4, 4]])  # a video of two temporal patches: 8 tokens


def image_and_video_row(config) -> dict:
    """One row: text, an image, text, a video of two frames, text, a second image, text; pixel values for all."""
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(0, 190, (n,), generator=g)  # noqa: E731
    tokens = lambda n, token: torch.full((n,), token)  # noqa: E731
    merged = (IMAGE_GRID.prod(-1) // 4).tolist()
    frame = tokens(int(VIDEO_GRID[0, 1:].prod()) // 4, config.video_token_id)
    # Qwen3-VL writes a timestamp before each frame, so a video's frames are apart; Qwen2-VL's are one block
    video = [frame, text(2), frame] if config.model_type.startswith("qwen3") else [frame, frame]
    span = None
    if config.model_type == "glm4v_moe":  # frames of image tokens, each with its timestamp, inside the video's ids
        span = (config.video_start_token_id, config.video_end_token_id)
        frame = tokens(len(frame), config.image_token_id)
        video = [tokens(1, span[0]), frame, text(1), frame, text(1), tokens(1, span[1])]
    ids = torch.cat([text(5), tokens(merged[0], config.image_token_id), text(3), *video, text(4),
                     tokens(merged[1], config.image_token_id), text(4)]).view(1, -1)  # even: TP2 + SP
    v = config.vision_config
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    types = placeholder_types(ids, config.image_token_id, config.video_token_id, span).int()
    return {"input_ids": ids, "pixel_values": torch.randn(int(IMAGE_GRID.prod(-1).sum()), width, generator=g),
            "image_grid_thw": IMAGE_GRID,
            "pixel_values_videos": torch.randn(int(VIDEO_GRID.prod()), width, generator=g),
            "video_grid_thw": VIDEO_GRID, "mm_token_type_ids": types}
