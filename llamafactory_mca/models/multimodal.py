"""Vision-language models: Megatron's GPTModel for the language half, the Hugging Face vision tower for the other.

Where the vision tower lives: on the first pipeline stage only (the first virtual chunk), replicated on every
tensor-parallel rank, as ``transformers`` builds it. That is what ROLL and Megatron-Bridge do for Qwen2/2.5-VL: a
ViT of 0.6B parameters is a few percent of a step and splitting it over TP ranks buys little next to the language
model, while reusing the HF module keeps its windowed attention, rotary and merger exactly HF's. Stages after the
first never see pixels. The image (and video) features replace the embeddings at the placeholder tokens before the
decoder runs, so from there on the language model sees only embeddings; its positions are the 3-D multimodal
RoPE positions (``position_ids`` of shape [3, b, s], Megatron's ``mrope``).

Weight names: the language half keeps the text families' canonical names (``decoder.layers.*``, ``embedding.*``,
``output_layer``); the tower's parameters are ``vision.<its own name>``, read from and written to the HF
checkpoint's ``visual.<its own name>`` one to one (``vision_ops``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from .config import hf_config_object
from .mapping import Op, Rename, WeightTable

VISION_PREFIX = "vision."  # our name of the tower inside a model chunk
HF_VISION_PREFIX = "visual."  # its name in Hugging Face checkpoints (transformers' on-disk layout)


def _tower_class(hf: Any) -> type:
    """The vision tower class ``transformers`` builds for this VL config (the PreTrainedModel of its vision config,
    in the modeling module of the VL model), so the language model is never built beside it."""
    import inspect
    import sys

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    module = sys.modules[getattr(transformers, MODEL_MAPPING_NAMES[hf.model_type]).__module__]
    for obj in vars(module).values():
        if inspect.isclass(obj) and issubclass(obj, transformers.PreTrainedModel) and \
                getattr(obj, "config_class", None) is type(hf.vision_config):
            return obj
    raise ValueError(f"{hf.model_type}: no vision tower class for {type(hf.vision_config).__name__} in "
                     f"{module.__name__}")


def build_vision_tower(hf_config: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """The HF vision tower of a VL config (``hf_config``: the whole config.json), with random weights."""
    hf = hf_config_object(hf_config)
    return _tower_class(hf)._from_config(hf.vision_config, dtype=dtype)


def vision_ops(hf_config: dict[str, Any]) -> list[Op]:
    """One rename per parameter pattern of the tower (block indices become ``*``)."""
    with torch.device("meta"):
        tower = build_vision_tower(hf_config, torch.float32)
    patterns = sorted({WeightTable.pattern_of(name)[0] for name, _ in tower.named_parameters()})
    return [Rename(VISION_PREFIX + p, (HF_VISION_PREFIX + p,)) for p in patterns]


class VisionLanguageModel(GPTModel):
    """GPTModel whose first stage embeds images and videos into the token embeddings before the decoder.

    ``forward`` takes GPTModel's arguments plus ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` /
    ``video_grid_thw`` (all None for text-only micro-batches, and on later stages).
    """

    def __init__(self, *, hf_config: dict[str, Any], **gpt_kwargs: Any) -> None:
        # the features go in before the sequence-parallel scatter: ``embed`` scatters itself
        super().__init__(scatter_embedding_sequence_parallel=False, **gpt_kwargs)
        self.image_token_id = hf_config.get("image_token_id")
        self.video_token_id = hf_config.get("video_token_id")
        self.vision = None
        if self.pre_process:
            self.vision = build_vision_tower(hf_config, self.config.params_dtype)
            for param in self.vision.parameters():
                # replicated over tensor-parallel ranks, which see different gradients only through rounding:
                # Megatron's finalize_model_grads averages these over the TP group
                param.average_gradients_across_tp_domain = True

    def _features(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        output = self.vision(pixels.to(self.config.params_dtype), grid_thw=grid_thw)
        return output.pooler_output if hasattr(output, "pooler_output") else output

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
              video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [s, b, h] (sequence-parallel: this rank's part) with the vision features at the
        placeholder tokens."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        if pixel_values is None and pixel_values_videos is None and self.training:
            # a text-only micro-batch: a zero that touches every trainable tower parameter, so each gets its
            # (zero) gradient and DDP's overlapped bucket reduction is not left waiting for it
            trainable = [p.sum() for p in self.vision.parameters() if p.requires_grad]
            if trainable:
                embeddings = embeddings + 0.0 * torch.stack(trainable).sum().to(embeddings.dtype)
        for pixels, grid, token in ((pixel_values, image_grid_thw, self.image_token_id),
                                    (pixel_values_videos, video_grid_thw, self.video_token_id)):
            if pixels is None:
                continue
            features = self._features(pixels, grid).to(embeddings.dtype)
            mask = input_ids == token  # [b, s]: features fill row after row, as the rows hold their images
            if int(mask.sum()) != features.shape[0]:
                raise ValueError(f"{int(mask.sum())} placeholder tokens (id {token}) but {features.shape[0]} vision "
                                 "features: the rows and their images do not match")
            embeddings = embeddings.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), features).transpose(0, 1)
            embeddings = embeddings.contiguous()
        if self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        return embeddings

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, position_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                       video_grid_thw)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                               **kwargs)
