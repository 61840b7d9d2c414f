"""Llama 2 / 3 / 3.1 / 3.2 (llama3 rope scaling, tied embeddings): the base every family here builds on."""

from __future__ import annotations

from typing import Any

from ..config import McaConfig, check_rope, rope_settings
from ..mapping import Op, dense_layer, embeddings
from ..registry import Family, register


def _refuse(model_type: str, what: str, fix: str) -> None:
    raise ValueError(f"{model_type}: {what} is not supported by llamafactory_mca. {fix}")


@register("llama")
class LlamaFamily(Family):
    qkv_bias = False

    def check(self, hf: Any) -> None:
        if getattr(hf, "hidden_act", "silu") != "silu":
            _refuse(self.model_type, f"hidden_act={hf.hidden_act!r}", "Supported: silu (SwiGLU).")
        if getattr(hf, "attention_bias", False) and not self.qkv_bias:
            _refuse(self.model_type, "attention_bias=True (biases on q, k, v and o)", "Supported: no attention bias.")
        if getattr(hf, "mlp_bias", False):
            _refuse(self.model_type, "mlp_bias=True", "Supported: no MLP bias.")
        check_rope(self.model_type, rope_settings(hf)[1])

    def transformer(self, hf: Any) -> dict[str, Any]:
        heads = hf.num_attention_heads
        return dict(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            ffn_hidden_size=hf.intermediate_size,
            num_attention_heads=heads,
            num_query_groups=getattr(hf, "num_key_value_heads", None) or heads,
            kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            normalization="RMSNorm",
            layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True,
            activation="silu",
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
            init_method_std=getattr(hf, "initializer_range", 0.02),
        )

    def config_from_hf(self, hf: Any) -> McaConfig:
        self.check(hf)
        theta, scaling = rope_settings(hf)
        return McaConfig(
            hf_model_type=self.model_type,
            transformer=self.transformer(hf),
            vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            rotary_base=theta,
            rope_parameters=scaling,
            sliding_window=self.sliding_window(hf),
            hf_config=hf.to_dict(),
        )

    def sliding_window(self, hf: Any) -> int | None:
        return None

    def weights(self, config: McaConfig) -> list[Op]:
        return embeddings(config.tie_word_embeddings) + dense_layer(qkv_bias=self.qkv_bias)
