"""McaConfig: a model's architecture in Megatron terms, plus what it takes to go back to Hugging Face.

A family's ``config_from_hf`` fills ``transformer`` (TransformerConfig keyword arguments that describe
the architecture) and the model-level fields. The run's layout and engine knobs are laid on top only
when the TransformerConfig is built (``to_transformer_config``), so ``mca_config.json`` in a
checkpoint describes the model, never the layout it happened to be trained in.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from ..errors import UserError
from .mapping import in_linear_attention_layers, in_moe_layers, is_linear_attention_layer, is_moe_layer
from .spec import NATIVE_OPTIONS, prepare_config


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (HF's ``gelu_pytorch_tanh``: Gemma's GeGLU)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


# Activation names stored in JSON; TransformerConfig wants callables. quick_gelu (x·sigmoid(1.702x), gpt-oss's
# clamped SwiGLU) must be megatron-core's own function object: TransformerConfig's checks compare by identity.
_ACTIVATIONS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu, "gelu_tanh": gelu_tanh,
                "quick_gelu": quick_gelu}
# Architecture fields of ours that megatron-core's TransformerConfig lacks, set on it as attributes for the layers that
# read them (``native/sublayers.py``, ``native/cross_entropy.LanguageModel``): a norm on each sublayer's output
# (Gemma's sandwich norms), the word embeddings' multiplier (Gemma: sqrt(hidden)), the RoPE base of the windowed
# layers where it is not the others' (Gemma 3: 10,000 local, 1,000,000 global).
# ``image_look_ahead``: an image's tokens also see the image's later tokens (Gemma 3, ``native/attention.py``;
# "windowed": on the windowed layers only, Gemma 4's).
# ``padding_idx``: the word embedding row that lookups never train (transformers' ``pad_token_id``).
# ``qk_norm_across_heads``: the q/k norms normalise all heads of a token at once (MiniMax-M2, ``native/norm.py``).
# Gemma 4's: ``global_attention`` (the full-attention layers' own shape and RoPE: ``layer_configs``),
# ``value_norm`` (an RMSNorm without weight on each value head), ``layer_scalars`` (each layer's output times a
# stored scalar), ``final_logit_softcapping`` (logits = cap · tanh(logits / cap)), ``moe_block`` (a dense MLP beside
# the routed experts: ``native/moe_block.py``); the E2B/E4B's ``per_layer_inputs`` (each layer's own vector per token:
# ``native/per_layer_inputs.py``) and ``kv_sharing`` (the layers from ``first`` on attend with an earlier layer's keys
# and values, their MLP twice as wide where ``double_wide_mlp``: ``layer_configs``).
MODEL_OPTIONS = ("post_layer_norms", "embedding_multiplier", "window_rotary_base", "image_look_ahead", "padding_idx",
                 "qk_norm_across_heads", "global_attention", "value_norm", "layer_scalars", "final_logit_softcapping",
                 "moe_block", "per_layer_inputs", "kv_sharing")


class AttentionShape(NamedTuple):
    num_heads: int
    num_query_groups: int
    head_dim: int


def attention_shape(transformer: dict[str, Any]) -> AttentionShape:
    """Heads, query groups and head_dim of TransformerConfig fields, with TransformerConfig's own defaults
    (no GQA, head_dim = hidden / heads) so every size computed from the dict agrees with the built model."""
    heads = transformer["num_attention_heads"]
    return AttentionShape(heads, transformer.get("num_query_groups") or heads,
                          transformer.get("kv_channels") or transformer["hidden_size"] // heads)


@dataclass
class McaConfig:
    hf_model_type: str
    transformer: dict[str, Any]
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # the share of each head's dims that RoPE rotates (GLM-4.5: 0.5)
    rope_parameters: dict[str, Any] | None = None  # HF rope dict, replayed for inv_freq (llama3, linear)
    sliding_window: int | None = None  # HF's; the layers and reach are the transformer's window_size fields
    hf_config: dict[str, Any] = field(default_factory=dict)  # the source config.json, for the way back

    # ---- persistence (the file's name, reading and writing a folder's: checkpoints/) ---------------------------
    @classmethod
    def from_json_file(cls, path: str) -> McaConfig:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    # ---- Megatron ----------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.transformer["num_layers"]

    @property
    def mtp_num_layers(self) -> int:
        """Multi-token-prediction layers (DeepSeek-V3, GLM-4.5): canonically decoder layers ``num_layers`` on."""
        return self.transformer.get("mtp_num_layers") or 0

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_layers + self.mtp_num_layers

    def without_mtp(self) -> McaConfig:
        """This config with its multi-token-prediction layers left out (not built, trained or exported)."""
        transformer = {k: v for k, v in self.transformer.items() if k != "mtp_num_layers"}
        return dataclasses.replace(self, transformer=transformer)

    @property
    def num_experts(self) -> int | None:
        return self.transformer.get("num_moe_experts")

    def is_moe_layer(self, layer: int) -> bool:
        return is_moe_layer(self.num_experts, self.transformer.get("moe_layer_freq", 1), layer)

    def is_linear_attention_layer(self, layer: int) -> bool:
        return is_linear_attention_layer(self.transformer.get("linear_attention_freq"), layer)

    @property
    def vision_language(self) -> bool:
        """A vision tower feeds the decoder (the source config has a vision half)."""
        return bool(self.hf_config.get("vision_config"))

    @property
    def is_hybrid(self) -> bool:
        """Gated delta-rule layers among the full-attention ones (Qwen3-Next, Qwen3.5)."""
        return bool(self.transformer.get("linear_attention_freq"))

    def holds(self, pattern: str, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the canonical tensor ``pattern`` (models mixing dense and MoE layers,
        or linear- and full-attention layers, have some tensors in some layers only; a layer attending with another's
        keys has no key norm)."""
        moe, linear = in_moe_layers(pattern), in_linear_attention_layers(pattern)
        own_keys = not (pattern.endswith(".self_attention.k_layernorm.weight") and self.kv_source(layer) is not None)
        return ((moe is None or self.is_moe_layer(layer) == moe)
                and (linear is None or self.is_linear_attention_layer(layer) == linear) and own_keys)

    def kv_source(self, layer: int) -> int | None:
        """The layer (from 0) whose keys and values decoder layer ``layer`` attends with, where not its own (Gemma 4's
        E2B/E4B: from ``kv_sharing["first"]`` on, the last earlier layer of its kind, windowed or not)."""
        return kv_source(self.transformer.get("kv_sharing"), self.windowed, layer)

    @property
    def attention(self) -> AttentionShape:
        return attention_shape(self.transformer)

    def windowed(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (from 0) attends through a sliding window (``window_fields``)."""
        return windowed_layer(self.transformer, layer)

    @property
    def on_one_stage(self) -> bool:
        """Whether the model trains on one pipeline stage: Gemma 4 E2B/E4B's per-layer inputs and shared keys and
        values go from layer to layer beside the hidden states, which are all a stage hands on."""
        return bool(self.transformer.get("per_layer_inputs") or self.transformer.get("kv_sharing"))

    @property
    def recomputes_whole_layers(self) -> bool:
        """Whether full recompute trains the model right: not where layers attend with an earlier layer's keys and
        values (a recomputed layer hands them on without their gradients)."""
        return not self.transformer.get("kv_sharing")

    @property
    def global_attention_shape(self) -> AttentionShape:
        """The full-attention layers' heads where they are not the others' (Gemma 4: ``global_attention``)."""
        full = self.transformer["global_attention"]
        return AttentionShape(self.attention.num_heads, full["num_query_groups"], full["kv_channels"])

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Megatron pads the vocabulary to a multiple of tp × 128; the padding is trimmed on export."""
        multiple = 128 * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def to_transformer_config(self, overrides: dict[str, Any], **engine: Any):
        """TransformerConfig = architecture + the run's overrides (``args.get_config_dict()``) + engine fields."""
        kwargs = dict(self.transformer)
        activation = kwargs.pop("activation", "silu")
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        kwargs.update(engine)
        if self.sliding_window and "window_size" not in kwargs:  # written before the native kernels had windows
            kwargs |= window_fields(self.sliding_window, self.hf_config.get("layer_types"), kwargs["num_layers"])
        if kwargs.get("window_size") is not None:  # a tuple, which a saved config.json holds as a list
            kwargs["window_size"] = tuple(kwargs["window_size"])
        prepare_config(kwargs)  # before construction: some requests (fused RoPE without TE) fail inside it
        # Megatron fuses a GeGLU only for F.gelu, and its fused kernel is GELU's tanh approximation: fused, Gemma's
        # gelu_tanh is F.gelu; unfused (CPU), F.gelu would be the exact erf GELU, so gelu_tanh stays ours.
        fused_geglu = activation == "gelu_tanh" and kwargs.get("bias_activation_fusion") and kwargs.get(
            "gated_linear_unit")
        kwargs["activation_func"] = torch.nn.functional.gelu if fused_geglu else _ACTIVATIONS[activation]
        native = {k: kwargs.pop(k) for k in NATIVE_OPTIONS + MODEL_OPTIONS if k in kwargs}
        # multi-latent attention (DeepSeek-V3) has its own config class, with the latent ranks and YaRN fields
        cls = MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UserError(f"Unknown TransformerConfig fields {unknown} (from additional_configs or the model "
                             f"config); megatron-core's {cls.__name__} has no such fields.")
        if native.get("global_attention"):
            kwargs["heterogeneous_block_specs"] = True  # the block asks get_config_for_layer for each layer's config
        config = cls(**kwargs)
        for name, value in native.items():  # our layer spec's options ride on the config it is built from
            setattr(config, name, value)
        if native.get("global_attention"):
            layer_configs(config)
        return config


def windowed_layer(transformer: dict[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` (from 0) of TransformerConfig fields ``transformer`` is windowed."""
    return is_layer_window_attention(transformer.get("window_size"), transformer.get("window_attn_skip_freq"),
                                      layer + 1)


def kv_source(sharing: dict[str, Any] | None, windowed: Any, layer: int) -> int | None:
    """``McaConfig.kv_source`` from the ``kv_sharing`` field and a layer -> windowed? function."""
    if not sharing or layer < sharing["first"]:
        return None
    return _last_of_kind(sharing["first"], windowed, windowed(layer))


def _last_of_kind(first: int, windowed: Any, kind: bool) -> int | None:
    """The last layer before ``first`` that is windowed (``kind`` True) or not."""
    return max((i for i in range(first) if windowed(i) == kind), default=None)


def layer_configs(config: TransformerConfig) -> None:
    """Gemma 4's layers are of up to four kinds, each built from a config of its own. Its full-attention layers (the
    layers without a window) have wider heads (``global_head_dim``), their own number of key/value heads and, where
    ``attention_k_eq_v``, keys that are also the values; in the E2B/E4B the last layers attend with an earlier layer's
    keys and values (``kv_source``: its layer number), their MLP twice as wide where ``double_wide_mlp``. Megatron
    builds each layer from ``config.get_config_for_layer`` where ``heterogeneous_block_specs`` is set (its per-layer
    configs, Nemotron-NAS's), and then checkpoints each layer under keys of its own."""
    shape, sharing = config.global_attention, getattr(config, "kv_sharing", None)
    fields = {f.name for f in dataclasses.fields(config) if f.init}

    def variant(base: TransformerConfig, **changes: Any) -> TransformerConfig:
        other = dataclasses.replace(base, **{k: v for k, v in changes.items() if k in fields})
        for name, value in vars(base).items():  # ours, set on the config after it was built
            if name not in fields:
                setattr(other, name, value)
        for name, value in changes.items():
            if name not in fields:
                setattr(other, name, value)
        return other

    def windowed(layer: int) -> bool:
        return windowed_layer(vars(config), layer)

    full = variant(config, kv_channels=shape["kv_channels"], num_query_groups=shape["num_query_groups"],
                   keys_are_values=bool(shape.get("keys_are_values")))
    kinds = {True: config, False: full}
    shared = {}
    if sharing:
        wide = {"ffn_hidden_size": 2 * config.ffn_hidden_size} if sharing.get("double_wide_mlp") else {}
        for kind, base in kinds.items():
            source = _last_of_kind(sharing["first"], windowed, kind)
            if source is not None:
                shared[kind] = variant(base, kv_source=source + 1, **wide)

    def config_for_layer(layer_number: int) -> TransformerConfig:
        kind = windowed(layer_number - 1)
        return shared[kind] if sharing and layer_number - 1 >= sharing["first"] else kinds[kind]

    for each in (config, full, *shared.values()):
        each.get_config_for_layer = config_for_layer


def window_fields(window: int, layer_types: list[str] | None, num_layers: int) -> dict[str, Any]:
    """TransformerConfig's fields for HF's ``sliding_window`` W (a token sees itself and the W - 1 before it) on the
    layers ``layer_types`` names ``sliding_attention`` (every layer without such a list): ``window_size`` (W - 1, 0)
    and ``window_attn_skip_freq`` (1 for a windowed layer; None when all are)."""
    pattern = [int(kind == "sliding_attention") for kind in (layer_types or ["sliding_attention"] * num_layers)]
    if not any(pattern):
        return {}
    return dict(window_size=(window - 1, 0), window_attn_skip_freq=None if all(pattern) else pattern)


def rope_settings(hf_config: Any, layer_type: str = "full_attention") -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) from a transformers 4.x or 5.x config; of ``layer_type``'s layers where the
    config gives RoPE per kind of layer (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        scaling = getattr(hf_config, "rope_scaling", None)
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        return theta, (dict(scaling) if scaling else None)
    params = dict(params.get(layer_type) or {} if layer_typed_rope(params) else params)
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (None if kind == "default" else params)


def layer_typed_rope(rope_parameters: dict[str, Any] | None) -> bool:
    """Whether HF's ``rope_parameters`` holds one dict per kind of layer (Gemma 3: sliding and full attention)."""
    return bool(rope_parameters) and isinstance(rope_parameters.get("full_attention"), dict)


SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


def hf_config_object(hf_config: dict[str, Any]) -> Any:
    """The ``transformers`` config object of a saved config.json dict (``McaConfig.hf_config``)."""
    # here: transformers takes seconds to import; only a saved config's object needs it
    from transformers import AutoConfig as HfAutoConfig

    return HfAutoConfig.for_model(hf_config["model_type"], **{k: v for k, v in hf_config.items() if k != "model_type"})


def rope_inv_freq(config: McaConfig, head_dim: int) -> torch.Tensor | None:
    """HF's inverse frequencies for scaled RoPE kinds; None for plain RoPE (Megatron computes the same)."""
    if not config.rope_parameters:
        return None
    # here: imports transformers (as above), only for scaled RoPE
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = config.rope_parameters.get("rope_type", config.rope_parameters.get("type"))
    hf = hf_config_object(config.hf_config)
    hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    typed = {"layer_type": "full_attention"} if layer_typed_rope(getattr(hf, "rope_parameters", None)) else {}
    # YaRN's attention factor (transformers multiplies cos and sin by it) is in the softmax scale instead
    # (``rope_attention_scaling``), so the tables stay Megatron's unscaled ones
    inv_freq, _ = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"), **typed)
    if inv_freq.numel() * 2 != head_dim:
        raise UserError(f"rope inv_freq has {inv_freq.numel()} entries for head_dim={head_dim}; partial rotary "
                         "is not supported.")
    return inv_freq.float()


def rope_attention_scaling(hf_config: Any) -> float:
    """The factor transformers multiplies RoPE's cos and sin by (YaRN's attention factor; 1 for the other supported
    kinds). Rotating q and k by scaled tables scales every q·k by its square, and nothing else: the family folds it
    into the softmax scale (``families/base.DecoderFamily.transformer``)."""
    _, scaling = rope_settings(hf_config)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind != "yarn":
        return 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # here: imports transformers, only for YaRN

    return float(ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"))[1])


def check_rope(model_type: str, rope_parameters: dict[str, Any] | None) -> None:
    if not rope_parameters:
        return
    kind = rope_parameters.get("rope_type", rope_parameters.get("type"))
    if kind not in SUPPORTED_ROPE:
        raise UserError(f"{model_type}: rope scaling {kind!r} is not supported by llamafactory_mca; supported: "
                         f"{', '.join(SUPPORTED_ROPE)}. Training it would silently give a different model.")
