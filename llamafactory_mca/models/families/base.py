"""The family contract, and the generic decoder that every family here declares itself on.

A family says how one HF ``model_type`` becomes a Megatron model: what it refuses, the
TransformerConfig fields its config gives, and the ops that map its weights (``mapping.py``).
Sharding, file IO and export are generic and live elsewhere. Most decoders are Llama's layer plus a
few optional parts, so ``DecoderFamily`` is that layer and each part (``QKNorm``, ``MoE``) brings its
own config fields, refusals and weight ops: a family file only declares which parts it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from ..config import (
    AttentionShape,
    McaConfig,
    attention_shape,
    check_rope,
    layer_typed_rope,
    rope_attention_scaling,
    rope_settings,
    window_fields,
)
from ..mapping import (
    HF_LAYER,
    LAYER,
    GroupedRows,
    Op,
    Rename,
    WeightTable,
    dense_layer,
    embeddings,
    gated_mlp,
    mtp_module_names,
    mtp_ops,
    stacked_expert_biases,
    stacked_experts,
)
from ..multimodal import VisionLanguageModel, vision_ops
from ..native.cross_entropy import LanguageModel


def refuse(model_type: str, what: str, fix: str) -> NoReturn:
    raise ValueError(f"{model_type}: {what} is not supported by llamafactory_mca. {fix}")


def hf_attention_shape(hf: Any) -> AttentionShape:
    """HF's names for the attention sizes put into Megatron's, so HF's defaults and the built model's are one
    derivation (``config.attention_shape``)."""
    return attention_shape({"num_attention_heads": hf.num_attention_heads, "hidden_size": hf.hidden_size,
                            "num_query_groups": getattr(hf, "num_key_value_heads", None),
                            "kv_channels": getattr(hf, "head_dim", None)})


class Family:
    """What the bridge asks of a family (``model_type`` and ``decoder`` are set by ``registry.register``)."""

    model_type: str = ""
    decoder: str | None = None  # the text config's model_type it serves, where its type takes several (InternVL)
    # HF linears transformers runs without gradient (GLM-5's indexer): LLaMA-Factory's ``lora_target: all`` wraps
    # them, but their adapters never train (they stay zero); ``all`` leaves them out here
    no_gradient: tuple[str, ...] = ()

    def check(self, hf: Any) -> None:
        """Refuse what we cannot honour, so a run never silently trains a different model."""

    def config_from_hf(self, hf: Any) -> McaConfig:
        raise NotImplementedError

    def weights(self, config: McaConfig) -> list[Op]:
        raise NotImplementedError

    def weight_table(self, config: McaConfig) -> WeightTable:
        return WeightTable(self.weights(config))

    def build_chunk(self, mca: McaConfig, **gpt_kwargs: Any) -> Any:
        """One model chunk (a pipeline stage's part of the model) from GPTModel's arguments."""
        return LanguageModel(**gpt_kwargs)

    @property
    def source_aliases(self) -> tuple[tuple[str, str], ...]:
        """Other spellings of this family's HF names in checkpoints (``SafetensorsSource``)."""
        return ()


class Part:
    """An optional piece of the decoder layer; a new architectural feature is a new part, not a new base."""

    def check(self, model_type: str, hf: Any) -> None:
        """Refuse HF configs this part cannot honour."""

    def transformer(self, hf: Any) -> dict[str, Any]:
        """TransformerConfig fields, laid over the generic decoder's (``hf``: the text model's config)."""
        return {}

    def weights(self, config: McaConfig) -> list[Op]:
        return []


@dataclass(frozen=True)
class QKNorm(Part):
    """RMSNorm on each head's queries and keys before RoPE (Qwen3). ``switch``: the HF flag that turns it on
    (GLM-4.5's ``use_qk_norm``); None: always on. ``across_heads``: one RMSNorm over all heads of a token at once,
    q_proj's and k_proj's whole output (MiniMax-M2's, OLMo-2's; ``native/norm.ProjectionRMSNorm``)."""

    switch: str | None = None
    across_heads: bool = False

    def transformer(self, hf: Any) -> dict[str, Any]:
        on = True if self.switch is None else bool(getattr(hf, self.switch, False))
        return {"qk_layernorm": on} | ({"qk_norm_across_heads": True} if on and self.across_heads else {})

    def weights(self, config: McaConfig) -> list[Op]:
        if not config.transformer.get("qk_layernorm"):
            return []
        return [Rename(f"{LAYER}self_attention.{x}_layernorm.weight", (f"{HF_LAYER}self_attn.{x}_norm.weight",))
                for x in "qk"]


@dataclass(frozen=True)
class SharedExpert:
    """An expert every token goes through beside the routed ones. ``gate``: its output is scaled by a sigmoid
    of a learned projection of the token (Qwen2-MoE's ``shared_expert_gate``). ``hf_name``: its HF module beside
    the router (Qwen2-MoE ``shared_expert``, DeepSeek/GLM ``shared_experts``: n_shared_experts experts as one MLP)."""

    gate: bool
    hf_name: str = "shared_expert"

    def transformer(self, hf: Any) -> dict[str, Any]:
        size = getattr(hf, "shared_expert_intermediate_size", None) or hf.moe_intermediate_size * hf.n_shared_experts
        return {"moe_shared_expert_intermediate_size": size, "moe_shared_expert_gate": self.gate}

    def weights(self) -> list[Op]:
        ops = gated_mlp(f"{LAYER}mlp.shared_experts", f"{HF_LAYER}mlp.{self.hf_name}")
        if self.gate:
            ops.append(Rename(f"{LAYER}mlp.shared_experts.gate_weight", (f"{HF_LAYER}mlp.shared_expert_gate.weight",)))
        return ops


@dataclass(frozen=True)
class MoE(Part):
    """Routed experts replace the MLP of every layer (with ``sigmoid``: of every layer after the first dense ones).

    ``norm_topk``: renormalise the top-k routing weights (None: HF's ``norm_topk_prob`` decides).
    ``sigmoid``: DeepSeek-V3's routing (GLM-4.5's too): sigmoid scores, experts chosen by score + a per-expert
    correction bias (HF's ``e_score_correction_bias``, Megatron's ``expert_bias``, updated during training towards
    balanced loads: aux-loss-free balancing), optionally within the best ``topk_group`` of ``n_group`` groups (each
    scored by its two best experts, as in transformers: ``native/routing.py``), the
    chosen unbiased scores renormalised and scaled by ``routed_scaling_factor``; the first
    ``first_k_dense_replace`` layers are dense.
    ``expert_bias``: where the correction bias sits under ``hf_module`` (None: on the router, DeepSeek's; MiniMax-M2
    keeps it on the MoE block). Without ``n_group`` or ``routed_scaling_factor`` in the config: no groups, scale 1.
    ``hf_module``: the HF module holding the router (``gate``) and ``experts``; ``projections``: each expert's
    gate, up and down projection names. ``stacked``: the checkpoint stacks each layer's experts into one
    ``gate_up_proj`` and one ``down_proj`` tensor (Qwen3-VL-MoE) instead of a module per expert.
    """

    norm_topk: bool | None = None
    shared_expert: SharedExpert | None = None
    hf_module: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    stacked: bool = False
    stacked_out_in: bool = False  # stacked experts stored [E, out, in] (Qwen3.5-MoE), not the hub's [E, in, out]
    interleaved: bool = False
    router: str = "gate"
    sigmoid: bool = False
    expert_bias: str | None = None

    def check(self, model_type: str, hf: Any) -> None:
        step, dense = getattr(hf, "decoder_sparse_step", 1), getattr(hf, "mlp_only_layers", None)
        if step != 1 or dense:
            refuse(model_type, f"dense layers between MoE layers (decoder_sparse_step={step}, mlp_only_layers="
                   f"{dense})", "Supported: every layer an MoE layer.")
        if not self.sigmoid:
            return
        if not (hf.norm_topk_prob if self.norm_topk is None else self.norm_topk):
            refuse(model_type, "norm_topk_prob=False with sigmoid routing", "Megatron always renormalises the "
                   "chosen experts' sigmoid scores; supported: norm_topk_prob=True.")

    def transformer(self, hf: Any) -> dict[str, Any]:
        norm_topk = hf.norm_topk_prob if self.norm_topk is None else self.norm_topk
        fields = dict(
            num_moe_experts=(getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None)
                             or hf.num_local_experts),
            moe_ffn_hidden_size=getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size,
            moe_router_topk=hf.num_experts_per_tok,
            # HF: softmax over all experts, top-k, renormalise if norm_topk_prob = Megatron's softmax over the top-k.
            moe_router_pre_softmax=not norm_topk,
            # the checkpoint's weight, unless the recipe gives one (auto.resolve_load_balancing)
            moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
            moe_router_load_balancing_type="aux_loss",
        )
        if self.sigmoid:
            groups = getattr(hf, "n_group", None) or 1
            fields.update(
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
                moe_router_topk_scaling_factor=float(getattr(hf, "routed_scaling_factor", None) or 1.0),
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=hf.topk_group if groups > 1 else None,
                # HF's modeling (and so LLaMA-Factory's default path) trains these with no auxiliary loss; a recipe's
                # moe_aux_loss_coef adds DeepSeek-V3's sequence-wise one (auto.resolve_load_balancing)
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            )
            dense = getattr(hf, "first_k_dense_replace", 0) or 0
            if dense:
                fields["moe_layer_freq"] = [0] * dense + [1] * (hf.num_hidden_layers - dense)
        return fields | (self.shared_expert.transformer(hf) if self.shared_expert else {})

    def weights(self, config: McaConfig) -> list[Op]:
        hf, biases = f"{HF_LAYER}{self.hf_module}", config.transformer.get("add_bias_linear", False)
        ops = [Rename(f"{LAYER}mlp.router.{kind}", (f"{hf}.{self.router}.{kind}",))
               for kind in ("weight", "bias")[: 1 + biases]]
        if self.sigmoid:
            bias = self.expert_bias or f"{self.router}.e_score_correction_bias"
            ops.append(Rename(f"{LAYER}mlp.router.expert_bias", (f"{hf}.{bias}",)))
        if self.stacked:
            experts = (f"{LAYER}mlp.experts.local_experts.*", f"{hf}.experts")
            ops += stacked_experts(*experts, self.stacked_out_in, self.interleaved)
            ops += stacked_expert_biases(*experts, self.interleaved) if biases else []
        else:
            ops += gated_mlp(f"{LAYER}mlp.experts.local_experts.*", f"{hf}.experts.*", *self.projections)
        return ops + (self.shared_expert.weights() if self.shared_expert else [])


@dataclass(frozen=True)
class MultiTokenPrediction(Part):
    """Multi-token-prediction layers. Layer k combines the model's last hidden state at position i (``hnorm``) with
    the embedding of token i + k + 1 (``enorm``) through ``eh_proj``, runs one more decoder layer (full attention,
    of the last layer's MLP kind), and predicts token i + k + 2 through its own final norm and the shared output
    layer. Megatron's MTP block trains it, its loss weighted by ``mtp_loss_scaling_factor``. transformers implements
    none (it drops the layers on load), so a checkpoint saved by transformers has none; ``models/auto.py`` then
    builds the model without them.

    ``count``: the HF config's key for the number of layers. ``under_mtp``: where the checkpoint keeps them.
    DeepSeek-V3 and GLM-4.5 (``num_nextn_predict_layers``) store layer k as decoder layer ``num_layers + k``, with
    copies of the embedding and output layer; Qwen3-Next and Qwen3.5 (``mtp_num_hidden_layers``) store one layer
    under ``mtp.`` (``mapping.mtp_module_names``), sharing the model's embedding and output layer."""

    count: str = "num_nextn_predict_layers"
    under_mtp: bool = False

    def check(self, model_type: str, hf: Any) -> None:
        if self.under_mtp and (getattr(hf, self.count, 0) or 0) > 1:
            refuse(model_type, f"{self.count}={getattr(hf, self.count)}",
                   "Supported: one multi-token-prediction layer (its fc and norms are stored once, under mtp.).")

    def transformer(self, hf: Any) -> dict[str, Any]:
        layers = getattr(hf, self.count, 0) or 0
        return {"mtp_num_layers": layers} if layers else {}

    def weights(self, config: McaConfig) -> list[Op]:
        return mtp_ops() if config.mtp_num_layers else []

    def copied_embeddings(self, config: McaConfig) -> range:
        """The HF layer indices whose checkpoint entries repeat the embedding and output layer (see ``embeddings``)."""
        return range(0) if self.under_mtp else range(config.num_layers, config.num_layers_with_mtp)


@dataclass(frozen=True)
class GatedDeltaNet(Part):
    """Hybrid attention (Qwen3-Next, Qwen3.5): the layers ``layer_types`` marks ``linear_attention`` are gated
    delta-rule layers (``native/gated_delta.py``); the others are full attention with a sigmoid output gate (HF's
    ``q_proj`` gives each head [q | gate]), partial RoPE and zero-centred q/k norms. Every RMSNorm but the delta
    rule's output norm is zero-centred (scale 1 + weight).

    ``fused``: the checkpoint's projections are grouped per key head, [q k v z] in ``in_proj_qkvz`` and [beta alpha] in
    ``in_proj_ba`` (Qwen3-Next); otherwise flat ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``, ``in_proj_b``
    and ``in_proj_a`` (Qwen3.5). Both map into one layout grouped per key head, which TP splits by key heads."""

    fused: bool = True

    def check(self, model_type: str, hf: Any) -> None:
        kinds = set(hf.layer_types)
        if not kinds <= {"linear_attention", "full_attention"}:
            refuse(model_type, f"layer_types {sorted(kinds)}", "Supported: linear_attention and full_attention.")
        if hf.linear_num_value_heads % hf.linear_num_key_heads:
            refuse(model_type, f"linear_num_value_heads={hf.linear_num_value_heads} not a multiple of "
                   f"linear_num_key_heads={hf.linear_num_key_heads}", "Each key head must serve whole value heads.")

    def transformer(self, hf: Any) -> dict[str, Any]:
        return dict(
            linear_attention_freq=[int(kind == "linear_attention") for kind in hf.layer_types],
            linear_num_key_heads=hf.linear_num_key_heads, linear_num_value_heads=hf.linear_num_value_heads,
            linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
            linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
            attention_output_gate=True, layernorm_zero_centered_gamma=True,
        )

    def weights(self, config: McaConfig) -> list[Op]:
        t = config.transformer
        groups, dk = t["linear_num_key_heads"], t["linear_key_head_dim"]
        ratio = t["linear_num_value_heads"] // groups  # value heads per key head
        dv = ratio * t["linear_value_head_dim"]  # one key head's value width
        ours, theirs = f"{LAYER}self_attention.", f"{HF_LAYER}linear_attn."
        if self.fused:
            names, parts = ("qkvz", "ba"), ((0, 2 * dk + 2 * dv), (1, 2 * ratio))
        else:
            names, parts = ("qkv", "z", "b", "a"), ((0, dk), (0, dk), (0, dv), (1, dv), (2, ratio), (3, ratio))
        in_proj = GroupedRows(f"{ours}in_proj.weight", tuple(f"{theirs}in_proj_{n}.weight" for n in names),
                              parts=parts, groups=groups)
        conv = GroupedRows(f"{ours}conv1d.weight", (f"{theirs}conv1d.weight",), parts=((0, dk), (0, dk), (0, dv)),
                           groups=groups)
        renames = [("dt_bias", "dt_bias"), ("A_log", "A_log"), ("out_norm.weight", "norm.weight"),
                   ("out_proj.weight", "out_proj.weight")]
        return [in_proj, conv] + [Rename(f"{ours}{mine}", (f"{theirs}{hf}",)) for mine, hf in renames]


@dataclass(frozen=True)
class Vision(Part):
    """A vision tower (the HF module, on the first pipeline stage: ``models/multimodal.py``) whose image and video
    features replace the placeholder tokens' embeddings; the text half rotates by 3-D positions (mrope).

    ``tower_prefix`` / ``text_prefix``: where the tower and the language model sit in the HF checkpoint (Qwen2-VL's
    files keep the legacy ``visual.`` / ``model.``; Qwen3-VL's use ``model.visual.`` / ``model.language_model.``).
    ``interleaved_mrope``: the rotary frequencies take T, H, W in turn (Qwen3-VL) instead of in three blocks.
    ``default_mrope``: the sections transformers' rotary falls back to when the config has none (GLM-4.5V).
    ``video_frames_as_images``: a video is written as its frames' image tokens between the config's
    ``video_start_token_id`` and ``video_end_token_id``, and each frame is a row of its own for the tower (GLM-4.5V).
    Deepstack (Qwen3-VL: features of middle tower blocks added after the first decoder layers) follows from the
    config's ``deepstack_visual_indexes``.
    ``projector``: LLaVA's layout (Gemma 3, Gemma 4, InternVL): an encoder (transformers' auto class of
    the vision config) and the VL model's ``MultiModalProjector``; the text half rotates by plain RoPE.
    ``aliases``: other spellings of the checkpoint's prefixes (prefix as written here, prefix as another checkpoint
    stores it: Gemma 3's hub files nest the encoder deeper; a checkpoint may hold transformers' in-memory names).
    ``image_look_ahead``: an image's tokens see the whole image, later ones too (Gemma 3's bidirectional attention
    inside each image). A VL model type built over several decoders (InternVL) declares a family per decoder, each
    with the same ``Vision`` (``registry.register(model_type, decoder=...)``).
    """

    tower_prefix: str = "visual."
    text_prefix: str = "model."
    interleaved_mrope: bool = False
    default_mrope: tuple[int, ...] | None = None  # what transformers' rotary takes when the config names none
    video_frames_as_images: bool = False
    projector: bool = False
    aliases: tuple[tuple[str, str], ...] = ()
    image_look_ahead: bool = False

    def video_span(self, hf_config: dict[str, Any]) -> tuple[int, int] | None:
        """The ids opening and closing a video whose frames are image tokens (``video_frames_as_images``)."""
        if not self.video_frames_as_images:
            return None
        return hf_config["video_start_token_id"], hf_config["video_end_token_id"]

    def mrope_section(self, hf: Any) -> list[int] | None:
        section = _rope_dict(hf).get("mrope_section") or self.default_mrope
        return list(section) if section else None

    def check(self, model_type: str, hf: Any) -> None:
        if not self.projector and not self.mrope_section(hf):
            refuse(model_type, "a vision-language config without mrope_section", "Supported: multimodal RoPE.")

    def transformer(self, hf: Any) -> dict[str, Any]:
        fields = {} if self.projector else {"mrope_section": self.mrope_section(hf)}
        return fields | ({"image_look_ahead": True} if self.image_look_ahead else {})

    def weights(self, config: McaConfig) -> list[Op]:
        return vision_ops(config.hf_config, self.tower_prefix, self.projector)

    def text_ops(self, ops: list[Op]) -> list[Op]:
        """The language model's ops with their HF names under ``text_prefix``; in LLaVA's layout
        (``language_model.model.``) the output layer sits beside the decoder, under ``language_model.``."""
        if self.text_prefix == "model.":
            return ops
        head = self.text_prefix[:-len("model.")] if self.text_prefix.endswith(".model.") else ""

        def move(name: str) -> str:
            if name.startswith("model."):
                return self.text_prefix + name[len("model."):]
            return head + name if name.startswith("lm_head.") else name

        return [op.moved(move) for op in ops]


@dataclass(frozen=True)
class SandwichNorms(Part):
    """Gemma's norms: besides the norm before each sublayer, one on each sublayer's output before the residual add
    (``native/sublayers.py``). HF names them ``post_attention_layernorm`` (which in Llama's layout is the norm before
    the MLP), ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``."""

    pre_mlp_norm: str = "pre_feedforward_layernorm"

    def transformer(self, hf: Any) -> dict[str, Any]:
        return {"post_layer_norms": True}

    def weights(self, config: McaConfig) -> list[Op]:
        pairs = (("self_attention", "post_attention_layernorm"), ("mlp", "post_feedforward_layernorm"))
        return [Rename(f"{LAYER}{mine}.post_layernorm.weight", (f"{HF_LAYER}{hf}.weight",)) for mine, hf in pairs]


@dataclass(frozen=True)
class LinearBiases(Part):
    """Biases on every linear, o_proj's too (gpt-oss): Megatron's ``add_bias_linear``, which also gives the router and
    the experts theirs (``MoE.weights``). The experts' biases need each expert whole on its rank, and our grouped
    experts (``native/experts.py``): megatron-core's sequential ones add their bias in place to an autograd view."""

    def transformer(self, hf: Any) -> dict[str, Any]:
        return {"add_bias_linear": True, "add_qkv_bias": True, "moe_grouped_gemm": True}

    def weights(self, config: McaConfig) -> list[Op]:
        return [Rename(f"{LAYER}self_attention.linear_proj.bias", (f"{HF_LAYER}self_attn.o_proj.bias",))]


@dataclass(frozen=True)
class AttentionSinks(Part):
    """A learned logit per head that joins every softmax's denominator and takes no value (gpt-oss's ``sinks``):
    Megatron's ``softmax_type: learnable``, the native attention's ``softmax_offset``, split over TP by head."""

    def transformer(self, hf: Any) -> dict[str, Any]:
        return {"softmax_type": "learnable"}

    def weights(self, config: McaConfig) -> list[Op]:
        return [Rename(f"{LAYER}self_attention.core_attention.softmax_offset", (f"{HF_LAYER}self_attn.sinks",))]


@dataclass(frozen=True)
class ClampedSwiGLU(Part):
    """gpt-oss's expert activation: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g) with g = min(gate, limit).
    transformers hard-codes alpha 1.702 and limit 7 in its expert module, not the config; Megatron's quick_gelu is
    x · sigmoid(1.702 x), so only the limit is ours to give."""

    limit: float = 7.0

    def transformer(self, hf: Any) -> dict[str, Any]:
        return {"activation": "quick_gelu", "glu_linear_offset": 1.0, "activation_func_clamp_value": self.limit}


@dataclass(frozen=True)
class GemmaScales(Part):
    """Gemma 3's constants: norms scaled by 1 + weight (computed in fp32), word embeddings multiplied by sqrt(hidden),
    attention scores by ``query_pre_attn_scalar`` ** -0.5 instead of head_dim ** -0.5, and the sliding-window layers'
    own RoPE (HF's ``rope_parameters["sliding_attention"]``: base 10,000, unscaled) beside the global layers' (base
    1,000,000, linear scaling on the larger models)."""

    def check(self, model_type: str, hf: Any) -> None:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(hf, key, None):
                refuse(model_type, f"{key}={getattr(hf, key)}", "Supported: no logit soft-capping (Gemma 3's).")
        if getattr(hf, "use_bidirectional_attention", False):
            refuse(model_type, "use_bidirectional_attention=True", "Supported: causal attention.")
        window = _window_rope(hf)
        if window and window.get("rope_type", "default") != "default":
            refuse(model_type, f"rope_type={window['rope_type']!r} on the sliding-window layers",
                   "Supported: unscaled RoPE on them (Gemma 3's).")

    def transformer(self, hf: Any) -> dict[str, Any]:
        fields = dict(layernorm_zero_centered_gamma=True, embedding_multiplier=hf.hidden_size ** 0.5,
                      softmax_scale=hf.query_pre_attn_scalar ** -0.5)
        window = _window_rope(hf)
        if window and float(window["rope_theta"]) != rope_settings(hf)[0]:
            fields["window_rotary_base"] = float(window["rope_theta"])
        return fields


def _window_rope(hf: Any) -> dict[str, Any] | None:
    """The sliding-window layers' RoPE where the config gives RoPE per kind of layer."""
    return typed_rope(hf, "sliding_attention") or None


def _rope_dict(hf: Any) -> dict[str, Any]:
    return dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})


@dataclass(frozen=True)
class SlidingWindow:
    """HF's ``sliding_window`` on the layers HF's ``layer_types`` names (``config.window_fields``: Megatron's
    ``window_size`` and ``window_attn_skip_freq``, which the native attention and Transformer Engine read).
    ``switch``: the HF flag that turns it on (Qwen's ``use_sliding_window``); None: on whenever it is set."""

    switch: str | None = None

    def of(self, hf: Any) -> int | None:
        if self.switch and not getattr(hf, self.switch, False):
            return None
        window = getattr(hf, "sliding_window", None)
        return window if window and self.transformer(hf, window) else None

    def transformer(self, hf: Any, window: int | None = None) -> dict[str, Any]:
        window = window or self.of(hf)
        return window_fields(window, getattr(hf, "layer_types", None), hf.num_hidden_layers) if window else {}


def typed_rope(hf: Any, kind: str) -> dict[str, Any]:
    """The RoPE of ``kind``'s layers where the config gives RoPE per kind of layer (empty otherwise)."""
    params = getattr(hf, "rope_parameters", None)
    return dict(params.get(kind) or {}) if layer_typed_rope(params) else {}


@dataclass(frozen=True)
class Gemma4Layers(Part):
    """What Gemma 4's layers add to Gemma 3's: the full-attention layers' own heads (``global_attention``: their head
    size, key/value heads, keys that are the values, proportional RoPE), the values' weightless norm, q·k unscaled,
    the layer scalars, soft-capped logits, the 26B-A4B's MoE block beside the MLP (``enable_moe_block``:
    ``native/moe_block.py``), and the small models' per-layer inputs (``hidden_size_per_layer_input``:
    ``native/per_layer_inputs.py``) and last layers attending with an earlier layer's keys and values
    (``num_kv_shared_layers``), their MLP twice as wide (``use_double_wide_mlp``) (``families/gemma4.py``)."""

    def check(self, model_type: str, hf: Any) -> None:
        first = hf.num_hidden_layers - (hf.num_kv_shared_layers or 0)
        kinds = set(hf.layer_types[:first]) if 0 < first < hf.num_hidden_layers else set(hf.layer_types)
        if not kinds >= set(hf.layer_types):
            refuse(model_type, f"num_kv_shared_layers={hf.num_kv_shared_layers} (the first {first} layers hold no "
                   f"{sorted(set(hf.layer_types) - kinds)} layer to share keys and values from)",
                   "Supported: sharing layers whose kind an earlier layer has.")
        # "vision" (the hub's): an image's tokens see one another on the windowed layers, text stays causal
        if getattr(hf, "use_bidirectional_attention", None) not in (None, False, "vision"):
            refuse(model_type, f"use_bidirectional_attention={hf.use_bidirectional_attention!r} (bidirectional "
                   "attention between all tokens)", "Supported: causal attention, or 'vision' as the hub's "
                   "checkpoints set it.")
        if not layer_typed_rope(hf.rope_parameters):
            refuse(model_type, f"rope_parameters={hf.rope_parameters}", "Supported: RoPE per kind of layer.")
        window, full = typed_rope(hf, "sliding_attention"), typed_rope(hf, "full_attention")
        if window.get("rope_type", "default") != "default" or window.get("partial_rotary_factor", 1.0) != 1.0:
            refuse(model_type, f"RoPE {window} on the sliding-window layers", "Supported: plain RoPE on whole heads.")
        if full.get("rope_type", "default") not in ("default", "proportional") or full.get("factor", 1.0) != 1.0:
            refuse(model_type, f"RoPE {full} on the full-attention layers",
                   "Supported: plain or proportional RoPE, unscaled (Gemma 4's).")

    def transformer(self, hf: Any) -> dict[str, Any]:
        full = typed_rope(hf, "full_attention")
        keys_are_values = bool(hf.attention_k_eq_v)
        groups = (hf.num_global_key_value_heads if keys_are_values and hf.num_global_key_value_heads
                  else hf.num_key_value_heads)
        fraction = full.get("partial_rotary_factor", 1.0) if full.get("rope_type") == "proportional" else 1.0
        fields = dict(embedding_multiplier=hf.hidden_size ** 0.5, softmax_scale=1.0, value_norm=True,
                      layer_scalars=True, final_logit_softcapping=hf.final_logit_softcapping or None,
                      global_attention=dict(kv_channels=hf.global_head_dim or hf.head_dim, num_query_groups=groups,
                                            keys_are_values=keys_are_values,
                                            rotary_base=float(full.get("rope_theta", 1e6)), rope_fraction=fraction))
        if hf.hidden_size_per_layer_input:
            fields["per_layer_inputs"] = dict(width=hf.hidden_size_per_layer_input,
                                              vocab=hf.vocab_size_per_layer_input)
        first = hf.num_hidden_layers - (hf.num_kv_shared_layers or 0)
        if 0 < first < hf.num_hidden_layers:  # transformers': from layer ``first`` on, when that is past layer 0
            fields["kv_sharing"] = dict(first=first, double_wide_mlp=bool(hf.use_double_wide_mlp))
        if hf.enable_moe_block:  # the dense MLP is Megatron's shared expert; transformers trains with no aux loss
            fields |= dict(moe_block=True, num_moe_experts=hf.num_experts,
                           moe_ffn_hidden_size=hf.moe_intermediate_size, moe_router_topk=hf.top_k_experts,
                           moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=hf.intermediate_size,
                           moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        return fields

    def weights(self, config: McaConfig) -> list[Op]:
        ops: list[Op] = [Rename(f"{LAYER}layer_scalar", (f"{HF_LAYER}layer_scalar",))]
        if config.transformer.get("per_layer_inputs"):
            model = [("embedding", "embed_tokens_per_layer"), ("linear_proj", "per_layer_model_projection"),
                     ("norm", "per_layer_projection_norm")]
            layer = [("linear_fc1", "per_layer_input_gate"), ("linear_fc2", "per_layer_projection"),
                     ("post_norm", "post_per_layer_input_norm")]
            ops += [Rename(f"per_layer_inputs.{mine}.weight", (f"model.{hf}.weight",)) for mine, hf in model]
            ops += [Rename(f"{LAYER}per_layer_input.{mine}.weight", (f"{HF_LAYER}{hf}.weight",)) for mine, hf in layer]
        if not config.transformer.get("moe_block"):
            return ops
        renames = [("router.weight", "router.proj.weight"), ("router.scale", "router.scale"),
                   ("router.per_expert_scale", "router.per_expert_scale"),
                   ("dense_post_norm.weight", "post_feedforward_layernorm_1.weight"),
                   ("pre_experts_norm.weight", "pre_feedforward_layernorm_2.weight"),
                   ("experts_post_norm.weight", "post_feedforward_layernorm_2.weight")]
        return (ops + [Rename(f"{LAYER}mlp.{mine}", (f"{HF_LAYER}{hf}",)) for mine, hf in renames]
                + stacked_experts(f"{LAYER}mlp.experts.local_experts.*", f"{HF_LAYER}experts", out_in=True)
                + gated_mlp(f"{LAYER}mlp.shared_experts", f"{HF_LAYER}mlp"))


# HF's activation of a gated MLP -> ours (``config._ACTIVATIONS``): SwiGLU, and GeGLU with GELU's tanh approximation
GLU_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def hf_activation(hf: Any) -> str:
    return getattr(hf, "hidden_act", None) or getattr(hf, "hidden_activation", None) or "silu"


class DecoderFamily(Family):
    """Llama's decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases. A family sets what it adds."""

    qkv_bias: bool | None = False  # biases on q, k and v (not o); None: HF's attention_bias says
    qk_norm: QKNorm | None = None
    sandwich_norms: SandwichNorms | None = None
    gemma: GemmaScales | None = None
    moe: MoE | None = None
    sliding_window: SlidingWindow | None = None
    vision: Vision | None = None
    mtp: MultiTokenPrediction | None = None
    linear_attention: GatedDeltaNet | None = None
    linear_biases: LinearBiases | None = None
    sinks: AttentionSinks | None = None
    expert_activation: ClampedSwiGLU | None = None
    gemma4: Gemma4Layers | None = None

    def parts(self) -> list[Part]:
        """The declared parts, in the order their weight ops follow the layer's."""
        return [part for part in (self.qk_norm, self.sandwich_norms, self.gemma, self.gemma4, self.linear_attention,
                                  self.linear_biases, self.sinks, self.expert_activation, self.moe, self.mtp,
                                  self.vision) if part is not None]

    def check(self, hf: Any) -> None:
        if self.decoder not in (None, hf.model_type):  # looked up by its model_type alone (``families.get_family``)
            raise ValueError(f"{self.model_type}: the family of its {self.decoder} decoder was handed a "
                             f"{hf.model_type} decoder's config; look the family up by the config instead.")
        if hf_activation(hf) not in GLU_ACTIVATIONS:
            refuse(self.model_type, f"hidden_act={hf_activation(hf)!r}",
                   "Supported: silu (SwiGLU) and gelu_pytorch_tanh (GeGLU).")
        if getattr(hf, "attention_bias", False) and self.qkv_bias is False:
            refuse(self.model_type, "attention_bias=True (biases on q, k, v and o)", "Supported: no attention bias.")
        if getattr(hf, "mlp_bias", False):
            refuse(self.model_type, "mlp_bias=True", "Supported: no MLP bias.")
        self.check_rope(hf)
        for part in self.parts():
            part.check(self.model_type, hf)

    def check_rope(self, hf: Any) -> None:
        """Refuse RoPE scalings we cannot replay from HF (families with their own RoPE override it)."""
        check_rope(self.model_type, rope_settings(hf)[1])

    def transformer(self, hf: Any) -> dict[str, Any]:
        """TransformerConfig fields describing the architecture (never the run's layout)."""
        heads, groups, head_dim = hf_attention_shape(hf)
        fields = dict(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            # a model of MoE layers only may have no dense width (Qwen3.5-MoE): Megatron still wants one
            ffn_hidden_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True,
            activation=GLU_ACTIVATIONS[hf_activation(hf)],
            add_bias_linear=False,
            add_qkv_bias=bool(getattr(hf, "attention_bias", False)) if self.qkv_bias is None else self.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
            init_method_std=getattr(hf, "initializer_range", 0.02),
        )
        pad = getattr(hf, "pad_token_id", None)
        if isinstance(pad, int) and 0 <= pad < hf.vocab_size:  # transformers' embeddings: padding_idx=pad_token_id
            fields["padding_idx"] = pad
        for part in self.parts():
            fields |= part.transformer(hf)
        if self.sliding_window:
            fields |= self.sliding_window.transformer(hf)
        return fields | self.rope_attention(hf, fields)

    def rope_attention(self, hf: Any, fields: dict[str, Any]) -> dict[str, Any]:
        """YaRN's attention factor m: transformers scales RoPE's cos and sin by it, which scales q·k by m²; Megatron's
        tables are unscaled, so the softmax scale takes m² (the sinks, added after the scale, see none of it)."""
        m = rope_attention_scaling(hf)
        if m == 1.0:
            return {}
        return {"softmax_scale": (fields.get("softmax_scale") or fields["kv_channels"] ** -0.5) * m * m}

    def config_from_hf(self, hf: Any) -> McaConfig:
        """From the HF config; a vision-language config's text half (``text_config``) describes the decoder."""
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        self.check(text)
        theta, scaling = rope_settings(text)
        return McaConfig(
            hf_model_type=self.model_type,
            transformer=self.transformer(text),
            vocab_size=text.vocab_size,
            max_position_embeddings=text.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            rotary_base=theta,
            # transformers 5 keeps it in rope_parameters (and some configs beside them too)
            rotary_percent=float(getattr(text, "partial_rotary_factor", None)
                                 or _rope_dict(text).get("partial_rotary_factor") or 1.0),
            rope_parameters=scaling,
            sliding_window=self.sliding_window.of(text) if self.sliding_window else None,
            hf_config=hf.to_dict(),
        )

    def layer_ops(self, config: McaConfig, dense_mlp: bool) -> list[Op]:
        """A decoder layer's norms and attention, and its dense MLP where some layer has one (a family with another
        attention overrides this)."""
        pre_mlp = self.sandwich_norms.pre_mlp_norm if self.sandwich_norms else "post_attention_layernorm"
        return dense_layer(mlp="mlp" if dense_mlp else "", qkv_bias=config.transformer["add_qkv_bias"],
                           gated=config.transformer.get("attention_output_gate", False), pre_mlp_norm=pre_mlp)

    def weights(self, config: McaConfig) -> list[Op]:
        dense_mlp = not all(config.is_moe_layer(i) for i in range(config.num_layers))
        copies = self.mtp.copied_embeddings(config) if self.mtp else range(0)
        ops = embeddings(config.tie_word_embeddings, copies) + self.layer_ops(config, dense_mlp)
        for part in self.parts():
            if part is not self.vision:
                ops += part.weights(config)
        if self.vision is not None:
            ops = self.vision.text_ops(ops) + self.vision.weights(config)
        return ops

    @property
    def source_aliases(self) -> tuple[tuple[str, str], ...]:
        return self.vision.aliases if self.vision else ()

    @property
    def hf_layers(self) -> str:
        """Where the checkpoint keeps its decoder layers."""
        return (self.vision.text_prefix if self.vision else "model.") + "layers."

    def weight_table(self, config: McaConfig) -> WeightTable:
        if not (self.mtp and self.mtp.under_mtp and config.mtp_num_layers):
            return WeightTable(self.weights(config))
        return WeightTable(self.weights(config), stored=mtp_module_names(self.hf_layers, config.num_layers))

    def build_chunk(self, mca: McaConfig, **gpt_kwargs: Any) -> Any:
        """With a vision tower, our VisionLanguageModel (GPTModel + the tower on the first stage)."""
        if self.vision is None:
            return super().build_chunk(mca, **gpt_kwargs)

        return VisionLanguageModel(hf_config=mca.hf_config, vision=self.vision, **gpt_kwargs)
