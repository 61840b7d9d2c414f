"""The native layer spec's modules: PyTorch kernels where Megatron-Core would need Transformer Engine.

- ``attention.py``: core attention (SDPA for padded batches, ``varlen_attn`` for packed THD ones, CP)
- ``kernels.py``: the attention math itself (padded SDPA, causal segments)
- ``context_parallel.py``: context-parallel attention (K/V all-gather, segment plans; the token split is in data/)
- ``norm.py``: torch RMSNorm/LayerNorm that work with sequence parallelism
- ``experts.py``: grouped MoE experts on ``torch._grouped_mm``; ``dispatch.py``: their sync-free token routing
- ``rope.py``: packed (THD) RoPE without host syncs
- ``cross_entropy.py``: the language-model loss from bf16 logits (no fp32 copy), and GPTModel with it
- ``wgrad.py``: weight-gradient accumulation into fp32 main_grad without apex (torch's addmm with out_dtype; for
  the MoE experts ``grouped_wgrad.py``'s Triton GEMM on GPUs, torch's grouped GEMM and an add elsewhere)
- ``embedding.py``: the word embeddings' (and Gemma 4's per-layer table's) backward adds the looked-up rows into
  DDP's main_grad instead of a dense gradient as large as the table
- ``tower_attention.py``: the HF vision towers' attention in one ``varlen_attn`` call per block
- ``fp8.py``: FP8 GEMMs without TE (``fp8``/``fp8_recipe``): the parallel linears' matmul function on
  ``torch._scaled_mm``, the grouped experts' on ``torch._scaled_grouped_mm``; ``fp8_triton.py`` its cast;
  ``fp8_cublaslt.py`` the weight gradient added into main_grad inside cuBLASLt's GEMM
- ``routing.py``: group-limited routing (DeepSeek-V3) with transformers' group score; a frozen router's backward

- ``norm_triton.py``, ``rope_triton.py``, ``swiglu_triton.py``, ``loss_triton.py``, ``combine_triton.py``: the q/k
  norms, (1 + weight) norms, RoPE, SwiGLU, the loss's row passes and the MoE combine as Triton kernels on GPUs (each
  was torch.compile'd, whose graphs were most of a first step on a fresh machine; Triton compiles once per machine)
"""


def install() -> None:
    """Put our kernels where megatron-core 0.16 calls its slow fallbacks; idempotent, before a model is built.

    - Its unfused RoPE for packed (THD) batches reads cu_seqlens on the host, four syncs per layer and micro-batch;
      ``rope.py`` computes the same on the device.
    - Without apex, ``gradient_accumulation_fusion`` needs apex's fused_weight_gradient_mlp_cuda; torch's addmm
      with out_dtype is the same GEMM (``wgrad.py``).
    - ``apply_rope_fusion`` calls TE's fused RoPE through two slots that are empty without TE; ``rope.py`` fills them
      with the same rotation compiled.
    - Its group-limited routing scores a group unlike transformers where top-k is not twice the groups chosen, and
      its router's backward computes a frozen router's weight gradient (``routing.py``).
    - Its MLP's fused SwiGLU and GeGLU are torch.compile'd; ``swiglu_triton.py`` is the same math in Triton.
    """
    # here: this package loads without Megatron (its kernels); only install() patches Megatron
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import mlp
    from megatron.core.transformer.moe import moe_utils, router

    # here: Triton kernels, loaded only where a model is prepared
    from . import rope, routing, swiglu_triton, wgrad

    if moe_utils.group_limited_topk is routing.MEGATRON_GROUP_LIMITED_TOPK:
        moe_utils.group_limited_topk = routing.group_limited_topk
    # without TE (its GEMM is what megatron-core's backward calls where TE is installed)
    if router.router_gating_linear is routing.MEGATRON_GATING and getattr(moe_utils, "te_general_gemm", None) is None:
        router.router_gating_linear = routing.router_gating_linear

    if rope_utils._apply_rotary_pos_emb_thd is rope.MEGATRON_THD_ROPE:
        rope_utils._apply_rotary_pos_emb_thd = rope.apply_rotary_pos_emb_thd
    if rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb = rope.fused_apply_rotary_pos_emb
        rope_utils.fused_apply_rotary_pos_emb_thd = rope.fused_apply_rotary_pos_emb_thd
    if mlp.bias_swiglu_impl is swiglu_triton.MEGATRON_SWIGLU:
        mlp.bias_swiglu_impl = swiglu_triton.bias_swiglu_impl
        mlp.weighted_bias_swiglu_impl = swiglu_triton.weighted_bias_swiglu_impl
    if mlp.bias_geglu_impl is swiglu_triton.MEGATRON_GEGLU:
        mlp.bias_geglu_impl = swiglu_triton.bias_geglu_impl
    if not layers._grad_accum_fusion_available and wgrad.available():
        layers.fused_weight_gradient_mlp_cuda = wgrad
        layers._grad_accum_fusion_available = True
