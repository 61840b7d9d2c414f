"""gpt-oss (gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases on q, k, v and o and a learned sink logit
per head, a 128-token window on every other layer, YaRN (an attention factor, no truncation), then MoE on every
layer: a router with a bias (softmax over the top-k logits), experts stacked with gate and up interleaved, biased, and
a clamped SwiGLU. The hub's checkpoints store the experts in MXFP4; they load dequantized to bf16
(``checkpoints/hf_io.SafetensorsSource``) and export as bf16."""

from dataclasses import replace
from typing import Any

from ..config import McaConfig
from ..registry import register
from .base import AttentionSinks, ClampedSwiGLU, DecoderFamily, LinearBiases, MoE, SlidingWindow, refuse


@register("gpt_oss")
class GptOssFamily(DecoderFamily):
    qkv_bias = True
    linear_biases = LinearBiases()
    sinks = AttentionSinks()
    expert_activation = ClampedSwiGLU(limit=7.0)
    moe = MoE(norm_topk=True, router="router", stacked=True, interleaved=True)
    sliding_window = SlidingWindow()

    def check(self, hf: Any) -> None:
        super().check(hf)
        self._check_quantization(hf)

    def _check_quantization(self, hf: Any) -> None:
        quantization = getattr(hf, "quantization_config", None) or {}
        method = quantization.get("quant_method") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", None)
        if quantization and method != "mxfp4":
            refuse(self.model_type, f"a {method} quantized checkpoint", "Supported: bf16, or the hub's MXFP4 experts "
                   "(loaded dequantized to bf16).")

    def config_from_hf(self, hf: Any) -> McaConfig:
        """Exported weights are bf16, so the config written beside them says nothing of MXFP4. A vision-language
        checkpoint (InternVL on gpt-oss) may say it at its top level or in its text half."""
        self._check_quantization(hf)
        config = super().config_from_hf(hf)
        hf_config = _without_quantization(config.hf_config)
        if isinstance(hf_config.get("text_config"), dict):
            hf_config["text_config"] = _without_quantization(hf_config["text_config"])
        return replace(config, hf_config=hf_config)


def _without_quantization(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in hf_config.items() if k != "quantization_config"}
