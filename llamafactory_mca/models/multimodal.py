"""Vision-language models: Megatron's GPTModel for the language half, the Hugging Face vision tower for the other.

Where the vision tower lives: on the first pipeline stage only (the first virtual chunk), replicated on every
tensor-parallel rank, as ``transformers`` builds it. That is what ROLL and Megatron-Bridge do for Qwen2/2.5-VL: a
ViT of 0.6B parameters is a few percent of a step and splitting it over TP ranks buys little next to the language
model, while reusing the HF module keeps its windowed attention, rotary and merger exactly HF's. Stages after the
first never see pixels. The image (and video) features replace the embeddings at the placeholder tokens before the
decoder runs, so from there on the language model sees only embeddings; its positions are the 3-D multimodal
RoPE positions (``position_ids`` of shape [3, b, s], Megatron's ``mrope``).

Qwen3-VL adds two things. Interleaved multimodal RoPE: the rotary frequencies take the T, H and W positions in turn
(``MultimodalRope``). Deepstack: the tower also returns features of some middle blocks, and feature i is added to
the hidden states at the vision tokens after decoder layer i. Those layers must sit in the first model chunk (the
workflow refuses layouts where they do not); the features travel to them as the decoder's ``context`` argument,
which Megatron's TransformerBlock hands to every layer (and to activation recomputation) and which self-attention
layers otherwise ignore.

Weight names: the language half keeps the text families' canonical names (``decoder.layers.*``, ``embedding.*``,
``output_layer``); the tower's parameters are ``vision.<its own name>``, read from and written to the HF
checkpoint's ``<tower prefix><its own name>`` one to one (``vision_ops``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import transformers
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region
from megatron.core.transformer.multi_token_prediction import roll_tensor

from ..data.multimodal import (
    IMAGE,
    VIDEO,
    image_blocks,
    image_token_id,
    placeholder_types,
    vl_model_class,
    vl_model_shell,
)
from ..errors import UserError
from .config import hf_config_object
from .mapping import VISION_PREFIX, Op, Rename, WeightTable
from .native import tower_attention
from .native.cross_entropy import LanguageModel


def _tower_class(hf: Any) -> type:
    """The vision tower class ``transformers`` builds for this VL config (the PreTrainedModel of its vision config,
    in the modeling module of the VL model), so the language model is never built beside it."""
    module = sys.modules[vl_model_class(hf.model_type).__module__]
    for obj in vars(module).values():
        if inspect.isclass(obj) and issubclass(obj, transformers.PreTrainedModel) and \
                getattr(obj, "config_class", None) is type(hf.vision_config):
            return obj
    raise ValueError(f"{hf.model_type}: no vision tower class for {type(hf.vision_config).__name__} in "
                     f"{module.__name__}")


class TowerWithProjector(torch.nn.Module):
    """LLaVA's layout (Gemma 3, InternVL): transformers' encoder for the vision config and the VL model's projector,
    under the names transformers gives them, so the checkpoint maps one to one. The features are the VL model's own
    ``get_image_features`` (Gemma 3's projector pools the patches to a fixed count per image; InternVL's drops the
    class token and folds 2 x 2 patches into one before its projector), run on a VL model that holds these two parts
    and no language model. Images come whole and of one size: SDPA over the batch of images is already one call per
    block."""

    def __init__(self, hf: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.vision_tower = transformers.AutoModel.from_config(hf.vision_config, dtype=dtype,
                                                               attn_implementation="sdpa")
        name, projector = _projector(hf)
        setattr(self, name, projector.to(dtype))
        if getattr(hf, "audio_config", None) is not None:
            # Gemma 4's E2B/E4B: carried, never run (audio inputs are refused), so the merged model keeps its hearing;
            # frozen whatever freeze_vision_tower says: no gradient ever reaches it
            self.audio_tower = transformers.AutoModel.from_config(hf.audio_config, dtype=dtype)
            self.embed_audio = _vl_class(hf, "MultimodalEmbedder")(hf.audio_config, hf.get_text_config()).to(dtype)
            for module in (self.audio_tower, self.embed_audio):
                module.requires_grad_(False)
        features = vl_model_shell(hf)
        features.vision_tower = self.vision_tower
        setattr(features, name, getattr(self, name))
        object.__setattr__(self, "_features", features)  # not a submodule: the parameters are this module's

    def forward(self, pixel_values: torch.Tensor, grid_thw: None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[images, channels, height, width] -> [images, tokens per image, hidden]; Gemma 4's: [images, patches,
        patch pixels] with each patch's (x, y) (``position_ids``, -1 for padding) -> [its images' tokens, hidden]."""
        extra = {} if position_ids is None else {"image_position_ids": position_ids}
        return self._features.get_image_features(pixel_values=pixel_values, return_dict=True, **extra).pooler_output


def _projector(hf: Any) -> tuple[str, torch.nn.Module]:
    """The VL model's projector under its name there: LLaVA's ``multi_modal_projector`` (Gemma 3, InternVL), or
    Gemma 4's ``embed_vision`` (a weightless RMSNorm and a linear, ``*MultimodalEmbedder``)."""
    try:
        return "multi_modal_projector", _vl_class(hf, "MultiModalProjector")(hf)
    except ValueError:
        return "embed_vision", _vl_class(hf, "MultimodalEmbedder")(hf.vision_config, hf.get_text_config())


def _vl_class(hf: Any, suffix: str) -> type:
    """The class named ``*<suffix>`` in the modeling module of the VL model of ``hf``."""
    module = sys.modules[vl_model_class(hf.model_type).__module__]
    for name, obj in vars(module).items():
        if name.endswith(suffix) and isinstance(obj, type):
            return obj
    raise ValueError(f"{hf.model_type}: no class named *{suffix} in {module.__name__}")


def build_vision_tower(hf_config: dict[str, Any], dtype: torch.dtype, projector: bool = False) -> torch.nn.Module:
    """The HF vision tower of a VL config (``hf_config``: the whole config.json), with random weights: the VL model's
    own tower class, its attention one variable-length call per block (``native/tower_attention.py``), or with
    ``projector`` LLaVA's encoder and projector (``TowerWithProjector``)."""
    hf = hf_config_object(hf_config)
    if projector:
        return TowerWithProjector(hf, dtype)
    tower = _tower_class(hf)._from_config(hf.vision_config, dtype=dtype, attn_implementation="sdpa")
    # set after the build: transformers' check would look for a flash-attn kernel behind a name with "flash" in it
    tower.config._attn_implementation = tower_attention.ATTENTION
    return tower


def vision_ops(hf_config: dict[str, Any], hf_prefix: str, projector: bool = False) -> list[Op]:
    """One rename per parameter pattern of the tower (block indices become ``*``); ``hf_prefix``: the tower's place
    in the HF checkpoint."""
    with torch.device("meta"):
        tower = build_vision_tower(hf_config, torch.float32, projector)
    patterns = sorted({WeightTable.pattern_of(name)[0] for name in tower.state_dict()})  # stored buffers too
    return [Rename(VISION_PREFIX + p, (hf_prefix + p,)) for p in patterns]


def deepstack_layers(hf_config: dict[str, Any]) -> int:
    """How many of the first decoder layers receive deepstack features (0 without deepstack)."""
    return len(hf_config.get("vision_config", {}).get("deepstack_visual_indexes") or [])


def check_vision_layout(config: Any, layout: Any, custom_pipeline_layout: bool = False) -> None:
    """What a vision-language model needs of the layout (the run's plan and the planner's search ask alike): no
    context parallelism, and its deepstack layers on the tower's stage. ``custom_pipeline_layout``: a
    pipeline_model_parallel_layout places the layers, not the even split (the model build then checks where the
    deepstack layers went)."""
    if not config.vision_language:
        return
    if layout.cp > 1:
        raise UserError(f"context_parallel_size={layout.cp} is not supported for the vision-language model "
                        f"{config.hf_model_type} yet (its image features would have to follow the token split); "
                        "use context_parallel_size: 1.")
    deepstack, stages = deepstack_layers(config.hf_config), layout.pp * (layout.vpp or 1)
    first_chunk = config.num_layers // stages
    if deepstack > first_chunk and not custom_pipeline_layout:
        raise UserError(f"{config.hf_model_type}: the first {deepstack} decoder layers take the vision tower's "
                        f"deepstack features and must share its pipeline stage, but pipeline_model_parallel_size="
                        f"{layout.pp}" + (f" x virtual_pipeline_model_parallel_size={layout.vpp}" if layout.vpp
                                          else "") + f" puts {first_chunk} layers there. Use fewer stages (at "
                        f"most {config.num_layers // deepstack}) or a pipeline_model_parallel_layout whose first "
                        f"stage holds {deepstack} layers.")


class MultimodalRope(torch.nn.Module):
    """Multimodal RoPE from 3-D positions, with the frequencies laid out as the family does: in three blocks
    (T..., H..., W...: Qwen2-VL, what Megatron's MultimodalRotaryEmbedding does) or interleaved (THWTHW...T:
    Qwen3-VL, ``transformers``' ``apply_interleaved_mrope``). Megatron has only the first; one gather of the
    frequencies by axis gives both. Takes Megatron's place (``inv_freq`` from it) and its call signature."""

    def __init__(self, megatron_rope: torch.nn.Module, interleaved: bool) -> None:
        super().__init__()
        self.inv_freq = megatron_rope.inv_freq
        self.interleaved = interleaved
        self._axes: dict[tuple, torch.Tensor] = {}  # per (sections, device): built once, not copied every step

    def axes(self, mrope_section: list[int]) -> torch.Tensor:
        """For each frequency, the position axis (0 T, 1 H, 2 W) it rotates by."""
        if not self.interleaved:
            return torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        axes = torch.zeros(sum(mrope_section), dtype=torch.long)
        for axis in (1, 2):
            axes[axis: 3 * mrope_section[axis]: 3] = axis
        return axes

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group: Any = None) -> torch.Tensor:
        """``position_ids`` [3, b, s] → rotary embedding [s, b, 1, head_dim] (Megatron's layout)."""
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * inv_freq  # [3, b, s, head_dim / 2]
        key = (tuple(mrope_section), position_ids.device)
        if key not in self._axes:
            self._axes[key] = self.axes(mrope_section).to(position_ids.device)
        axes = self._axes[key]
        freqs = freqs.gather(0, axes.expand_as(freqs[:1]).contiguous())[0]  # [b, s, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, :, None, :].transpose(0, 1).contiguous()


class VisionLanguageModel(LanguageModel):
    """GPTModel whose first stage embeds images and videos into the token embeddings before the decoder.

    ``forward`` takes GPTModel's arguments plus ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` /
    ``video_grid_thw`` (all None for text-only micro-batches, and on later stages).
    """

    def __init__(self, *, hf_config: dict[str, Any], vision: Any, **gpt_kwargs: Any) -> None:
        # the features go in before the sequence-parallel scatter: ``embed`` scatters itself
        super().__init__(scatter_embedding_sequence_parallel=False, **gpt_kwargs)
        self.image_token_id = image_token_id(hf_config)
        self.video_token_id = hf_config.get("video_token_id")
        self.video_span = vision.video_span(hf_config)
        self.image_look_ahead = bool(getattr(self.config, "image_look_ahead", False))
        if not vision.projector:
            self.rotary_pos_emb = MultimodalRope(self.rotary_pos_emb, vision.interleaved_mrope)
        self.deepstack = deepstack_layers(hf_config)
        for layer in self.decoder.layers:
            if layer.layer_number <= self.deepstack:
                if not self.pre_process:
                    raise UserError(f"decoder layer {layer.layer_number - 1} takes deepstack features but is not "
                                     "in the first pipeline stage's first model chunk")
                layer.register_forward_hook(_add_deepstack, with_kwargs=True)
        self.vision = None
        if self.pre_process:
            # built where it will run, as transformers builds a model loaded with device_map: its random
            # initialisation (overwritten by the checkpoint's weights) took 15-19 s of a Qwen2.5-VL start on the
            # host's CPU, and takes milliseconds on the GPU
            with torch.device(torch.cuda.current_device() if torch.cuda.is_available() else "cpu"):
                self.vision = build_vision_tower(hf_config, self.config.params_dtype, vision.projector)
            for param in self.vision.parameters():
                # replicated over tensor-parallel ranks, which see different gradients only through rounding:
                # Megatron's finalize_model_grads averages these over the TP group
                param.average_gradients_across_tp_domain = True
        # while forward runs: [the input embeddings with the vision features (all positions), packed_seq_params]
        self._mtp_input: list | None = None
        if self.mtp_process:
            self.mtp.register_forward_pre_hook(self._give_mtp_the_inputs, with_kwargs=True)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
              video_grid_thw: torch.Tensor | None = None, image_position_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Token embeddings [s, b, h] (sequence-parallel: this rank's part) with the vision features at the
        placeholder tokens, the deepstack features laid out alike ([levels, s, b, h], zero at text tokens;
        None without deepstack or without images), and the embeddings at every position (for the MTP layer)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        if pixel_values is None and pixel_values_videos is None and self.training:
            # a text-only micro-batch: a zero that touches every trainable tower parameter, so each gets its
            # (zero) gradient and DDP's overlapped bucket reduction is not left waiting for it
            trainable = [p.sum() for p in self.vision.parameters() if p.requires_grad]
            if trainable:
                embeddings = embeddings + 0.0 * torch.stack(trainable).sum().to(embeddings.dtype)
        deepstack = None
        types = None
        for pixels, grid, kind in ((pixel_values, image_grid_thw, IMAGE),
                                   (pixel_values_videos, video_grid_thw, VIDEO)):
            if pixels is None:
                continue
            if kind == VIDEO and self.video_span is not None:
                # each frame a tower row of its own: [t, h, w] -> t x [1, h, w], as transformers' get_video_features
                grid = torch.repeat_interleave(grid, grid[:, 0], dim=0).index_fill(1, grid.new_tensor([0]), 1)
            where = {"position_ids": image_position_ids} if kind == IMAGE and image_position_ids is not None else {}
            output = self.vision(pixels.to(self.config.params_dtype), grid_thw=grid, **where)
            features = getattr(output, "pooler_output", output).to(embeddings.dtype)
            # [b, s]: features fill row after row, as the rows hold their images (their counts agree: the data
            # side checks that on the host, ``VisionInputs.attach``, so no step waits on a device-to-host copy)
            if types is None:
                types = placeholder_types(input_ids, self.image_token_id, self.video_token_id, self.video_span)
            mask = types == kind
            embeddings = _scatter(embeddings, mask, features)
            if self.deepstack:
                levels = output.deepstack_features
                if deepstack is None:
                    deepstack = [torch.zeros_like(embeddings) for _ in levels]
                deepstack = [_scatter(d, mask, level.to(d.dtype)) for d, level in zip(deepstack, levels)]
        whole = embeddings
        if self.config.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings)
            deepstack = None if deepstack is None else [scatter_to_sequence_parallel_region(d) for d in deepstack]
        return embeddings, (None if deepstack is None else torch.stack(deepstack)), whole

    def per_layer_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Images' and videos' tokens look up the padding id's per-layer embedding, as in transformers."""
        media = placeholder_types(input_ids, self.image_token_id, self.video_token_id, self.video_span) > 0
        return input_ids.masked_fill(media, self.config.padding_idx)

    def _give_mtp_the_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of the MTP block: the ``embedding`` GPTModel hands it (which would embed the shifted token
        ids: the placeholder token's embedding at an image) becomes ``_shifted_inputs``."""
        return args, {**kwargs, "embedding": self._shifted_inputs}

    def _shifted_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """What the MTP block embeds, once per MTP layer, with the token ids moved one more position left: the input
        embeddings moved alike, so at an image's placeholders it sees the image's features (as vLLM's drafting does).
        Moved as Megatron moves the ids (each packed sequence apart, its last position zero: a position whose MTP
        target is past the sequence, so its loss mask is zero), and split over sequence-parallel ranks like the
        decoder's input."""
        whole, packed_seq_params = self._mtp_input
        whole = roll_tensor(whole.permute(1, 2, 0), packed_seq_params=packed_seq_params)[0].permute(2, 0, 1)
        self._mtp_input[0] = whole
        if self.config.sequence_parallel:
            return scatter_to_sequence_parallel_region(whole)
        return whole

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                image_position_ids: torch.Tensor | None = None, images: bool = False, **kwargs: Any) -> torch.Tensor:
        """``images``: whether the micro-batch holds images (every stage is told; only the first has the pixels)."""
        whole = None
        if self.pre_process and decoder_input is None:
            decoder_input, deepstack, whole = self.embed(input_ids, pixel_values, image_grid_thw,
                                                         pixel_values_videos, video_grid_thw, image_position_ids)
            if deepstack is not None:
                kwargs["extra_block_kwargs"] = {"context": deepstack}
        if self.image_look_ahead and (images or pixel_values is not None):
            # the attention's mask, from the tokens every stage has; a micro-batch of text keeps the causal kernels
            # (varlen_attn, context parallelism)
            attention_mask = image_blocks(input_ids, self.image_token_id)
        if self.mtp_process:
            if whole is None:  # it sits with the tower: under pipelining ``resolve_mtp`` leaves it out
                raise RuntimeError("the multi-token-prediction layer of a vision-language model needs the first "
                                   "stage's input embeddings")
            self._mtp_input = [whole, kwargs.get("packed_seq_params")]
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   labels=labels, **kwargs)
        finally:
            self._mtp_input = None


def _scatter(hidden: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``hidden`` [s, b, h] with ``values`` at the positions of ``mask`` [b, s], taken row after row."""
    return hidden.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), values).transpose(0, 1).contiguous()


def _add_deepstack(layer: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    """Forward hook of the first decoder layers: add this layer's deepstack level (the ``context`` the decoder
    passes every layer; zero away from vision tokens, so adding it everywhere is exact)."""
    context = kwargs.get("context")
    if context is None:
        return output
    hidden, context_out = output
    return hidden + context[layer.layer_number - 1], context_out
