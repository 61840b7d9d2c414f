"""The data half of vision-language models: a micro-batch's pixels and its 3-D multimodal RoPE positions.

LLaMA-Factory already did the hard part while tokenising: its template's mm plugin expanded every image into as many
placeholder tokens as the vision tower will give features. Here, per micro-batch, the same plugin turns the rows'
images and videos into ``pixel_values`` / ``image_grid_thw`` (and the video pair), in the order their placeholders
appear, and ``transformers``' own ``get_rope_index`` gives each sequence its [3, n] positions — per sequence, so
positions restart inside a pack exactly as in an unpacked row.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from .batch import MicroBatch
from .rows import Sample


IMAGE, VIDEO = 1, 2  # mm_token_type_ids of transformers' get_rope_index


def placeholder_types(ids: torch.Tensor, image_token_id: int, video_token_id: int | None,
                      video_span: tuple[int, int] | None = None) -> torch.Tensor:
    """0 (text), IMAGE or VIDEO for each token of ``ids`` [..., s]. ``video_span``: the ids that open and close a
    video whose frames are image tokens (GLM-4.5V: ``<|begin_of_video|>`` ... ``<|end_of_video|>``); otherwise a
    video's placeholders are ``video_token_id``. A span never crosses a packed sequence's end, so a row's running
    count of opened spans is each sequence's."""
    types = torch.zeros_like(ids)
    images = ids == image_token_id
    if video_span is not None:
        inside = torch.cumsum((ids == video_span[0]).int() - (ids == video_span[1]).int(), dim=-1) > 0
        types[images & ~inside] = IMAGE
        types[images & inside] = VIDEO
        return types
    types[images] = IMAGE
    if video_token_id is not None:
        types[ids == video_token_id] = VIDEO
    return types


def image_token_id(hf_config: dict[str, Any]) -> int:
    """The image placeholder's id (Gemma 3's config.json calls it ``image_token_index``)."""
    return hf_config["image_token_id"] if "image_token_id" in hf_config else hf_config["image_token_index"]


def tokens_per_image(hf_config: dict[str, Any]) -> int | None:
    """Placeholder tokens per image (per tile, InternVL's) in LLaVA's layout, where every image is cut to one size;
    None where the count follows each image's patch grid (Qwen-VL's, GLM-4.5V's)."""
    return hf_config.get("mm_tokens_per_image") or hf_config.get("image_seq_length")  # Gemma 3's, InternVL's


def image_blocks(ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """For each token of ``ids`` [b, s], the index of the run of image tokens it belongs to in its row, -1 for the
    others: what Gemma 3's mask reads (transformers' ``token_type_ids`` groups), as its tokens see each other."""
    image = ids == image_token_id
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[..., :-1]
    return torch.where(image, torch.cumsum(starts.int(), dim=-1) - 1, -1)


def vl_model_class(model_type: str) -> type:
    """The VL model class (without its head) ``transformers`` builds for ``model_type``."""
    # here: data/ loads without transformers, which takes seconds to import; only VL models need it
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return getattr(transformers, MODEL_MAPPING_NAMES[model_type])


def vl_model_shell(config: Any) -> Any:
    """An instance of the HF VL model for ``config`` (transformers' config object) that holds only the config: its
    methods that read nothing else (``get_rope_index``), or the parts a caller gives it (the tower and projector for
    ``get_image_features``), run without building the model (billions of parameters)."""
    model_class = vl_model_class(config.model_type)
    shell = model_class.__new__(model_class)  # its __init__ would build every part
    torch.nn.Module.__init__(shell)
    shell.config = config
    return shell


def _rope_index(hf_config: dict[str, Any]):
    """``get_rope_index`` of the HF VL model, on a shell holding only its config."""
    import transformers  # here: see vl_model_class

    config = transformers.AutoConfig.for_model(**hf_config)  # model_type first, the rest as keywords
    return vl_model_shell(config).get_rope_index


class VisionInputs:
    """What a vision-language model needs beside the tokens, built at collation."""

    def __init__(self, mm_plugin: Any, processor: Any, hf_config: dict[str, Any],
                 video_span: tuple[int, int] | None = None, projector: bool = False) -> None:
        self.plugin, self.processor = mm_plugin, processor
        self.image_token_id, self.video_token_id = image_token_id(hf_config), hf_config.get("video_token_id")
        self.video_span = video_span
        self.model_type = hf_config["model_type"]
        # LLaVA's layout (``projector``: Gemma 3, Gemma 4, InternVL): plain 1-D positions, and every image the same
        # count of tokens (Gemma 4: as many as its valid patches pooled pool x pool, each image its own); otherwise
        # patch grids (t, h, w) merged merge x merge into tokens, and multimodal RoPE's 3-D positions
        self.projector = projector
        self.tokens_per_image = tokens_per_image(hf_config)
        if projector and self.tokens_per_image is None:
            self.pool = hf_config["vision_config"]["pooling_kernel_size"]
        elif self.tokens_per_image is None:
            self.rope_index = _rope_index(hf_config)
            self.merge = hf_config["vision_config"]["spatial_merge_size"]

    def types(self, ids: torch.Tensor) -> torch.Tensor:
        return placeholder_types(ids, self.image_token_id, self.video_token_id, self.video_span)

    def attach(self, batch: MicroBatch, samples: list[Sample]) -> MicroBatch:
        """``batch`` with its vision inputs (None without images or videos) and 3-D positions. A pair's two sequences
        (DPO's chosen and rejected answers, KTO's answer and KL sample) share their prompt's images, which each
        sequence holds placeholders for: they are given twice, in the order the sequences lie (packed: a pair's two
        together; padded: every first sequence, then every second)."""
        width = len(samples[0].sequences) if samples else 1
        order = [s for s in samples for _ in range(width)] if batch.packed else \
            [s for _ in range(width) for s in samples]
        images = [image for sample in order for image in sample.images]
        videos = [video for sample in order for video in sample.videos]
        if videos and self.projector:
            # LLaMA-Factory's plugin (InternVL's) gives a batch's video frames after all of its images, which the
            # placeholders, row after row, would take in another order: rows would train on each other's features
            raise UserError(f"{len(videos)} video(s) in a micro-batch of {self.model_type} (LLaVA's layout: InternVL, "
                            "Gemma 3, Gemma 4): videos are not supported there. Train on images, or drop the "
                            "dataset's videos column.")
        vision: dict[str, torch.Tensor] = {}
        if images or videos:
            inputs = self.plugin.get_mm_inputs(images, videos, [], [len(images)], [len(videos)], [0], [[]],
                                               self.processor)
            vision = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw", "image_position_ids",
                                                               "pixel_values_videos", "video_grid_thw")}
        self._check_counts(batch, vision)
        positions = None if self.projector or self.tokens_per_image else self._positions(batch, vision)
        return replace(batch, rope_positions=positions, vision=vision or None)

    def _check_counts(self, batch: MicroBatch, vision: dict[str, torch.Tensor]) -> None:
        """Placeholder tokens and vision features must pair one to one (the model fills the one with the other)."""
        types = self.types(batch.tokens)
        for key, kind in (("image_grid_thw", IMAGE), ("video_grid_thw", VIDEO)):
            if self.tokens_per_image:
                pixels = vision.get("pixel_values" if kind == IMAGE else "pixel_values_videos")
                features = 0 if pixels is None else len(pixels) * self.tokens_per_image
            elif self.projector:  # Gemma 4: each image's valid patches (not at (-1, -1)), pooled pool x pool
                patches = vision.get("image_position_ids") if kind == IMAGE else None
                features = 0 if patches is None else int((patches >= 0).all(-1).sum()) // self.pool ** 2
            else:
                features = sum(self._tokens(grid) for grid in vision.get(key, []))
            placeholders = int((types == kind).sum())
            if placeholders != features:
                raise ValueError(f"{placeholders} placeholder tokens but {features} vision features ({key}): the "
                                 "rows and their images or videos do not match")

    def _tokens(self, grid: torch.Tensor) -> int:
        """Placeholder tokens of one image or video: its patch grid (t, h, w) merged ``merge`` x ``merge``."""
        return int(np.prod(grid.tolist())) // self.merge ** 2

    def _positions(self, batch: MicroBatch, vision: dict[str, torch.Tensor]) -> torch.Tensor:
        """[b, s, 3]: each sequence's own 3-D positions (packed: restarting at every sequence)."""
        grids = {"image_grid_thw": list(vision.get("image_grid_thw", [])),
                 "video_grid_thw": list(vision.get("video_grid_thw", []))}
        rows, length = batch.tokens.shape
        out = torch.empty(rows, length, 3, dtype=torch.long)
        bounds = batch.cu_seqlens.tolist() if batch.packed else [0, length]
        for row in range(rows):
            for start, stop in zip(bounds[:-1], bounds[1:]):
                out[row, start:stop] = self._sequence(batch.tokens[row, start:stop], grids).T
        return out

    def _sequence(self, ids: torch.Tensor, grids: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """[3, n] for one sequence, taking its images' and videos' grids off the front of ``grids``."""
        types = self.types(ids)
        kwargs = {}
        for key, token_type in (("image_grid_thw", IMAGE), ("video_grid_thw", VIDEO)):
            tokens = int((types == token_type).sum())
            taken = []
            while tokens > 0:
                grid = grids[key].pop(0)
                taken.append(grid)
                tokens -= self._tokens(grid)
            if taken:
                kwargs[key] = torch.stack(taken)
        positions, _ = self.rope_index(ids.view(1, -1), mm_token_type_ids=types.view(1, -1), **kwargs)
        return positions[:, 0]
