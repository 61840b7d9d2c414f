"""The native layer spec's modules: PyTorch kernels where Megatron-Core would need Transformer Engine.

- ``attention.py``: core attention (SDPA for padded batches, ``varlen_attn`` for packed THD ones, CP)
- ``kernels.py``: the attention math itself (padded SDPA, causal segments)
- ``context_parallel.py``: context-parallel attention (K/V all-gather, segment plans; the token split is in data/)
- ``norm.py``: torch RMSNorm/LayerNorm that work with sequence parallelism
- ``experts.py``: grouped MoE experts on ``torch._grouped_mm``; ``dispatch.py``: their sync-free token routing
- ``rope.py``: packed (THD) RoPE without host syncs
- ``cross_entropy.py``: the language-model loss from bf16 logits (no fp32 copy), and GPTModel with it
- ``wgrad.py``: weight-gradient accumulation into fp32 main_grad without apex (torch's addmm with out_dtype)
"""
