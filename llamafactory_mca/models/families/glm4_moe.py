"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (``glm4_moe``): grouped-query attention with q/k/v biases (``attention_bias``),
optional qk-norm (``use_qk_norm``), RoPE on the first half of each head (``partial_rotary_factor``), the first
``first_k_dense_replace`` layers dense, then DeepSeek-V3-style MoE: sigmoid routing with a correction bias and
``n_shared_experts`` shared experts; multi-token-prediction layers (``num_nextn_predict_layers``, stored as
``model.layers.<num_hidden_layers>.*``) as DeepSeek-V3's."""

from ..registry import register
from .base import DecoderFamily, MoE, MultiTokenPrediction, QKNorm, SharedExpert


@register("glm4_moe")
class Glm4MoeFamily(DecoderFamily):
    qkv_bias = None  # HF's attention_bias: q, k and v (o_proj never has one)
    qk_norm = QKNorm(switch="use_qk_norm")
    moe = MoE(shared_expert=SharedExpert(gate=False, hf_name="shared_experts"), sigmoid=True)
    mtp = MultiTokenPrediction()
