"""The reference for the gated delta rule, shared by the CPU test of our torch rule and the GPU test of the kernel a
GPU picks: both are held against the same transformers code."""

import torch


def transformers_rule_per_sequence(q, k, v, g, beta, bounds: list[int]) -> torch.Tensor:
    """transformers' ``torch_chunk_gated_delta_rule`` (fp32, q and k l2-normed in the kernel) on each sequence of the
    packed row alone, the key heads repeated for the value heads."""
    # imported in the call, as in the test files: collecting the tests does not load transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
    return torch.cat([torch_chunk_gated_delta_rule(*(t[:, s:e].float() for t in (q, k, v, g, beta)),
                                                   use_qk_l2norm_in_kernel=True)[0]
                      for s, e in zip(bounds[:-1], bounds[1:])], dim=1)
