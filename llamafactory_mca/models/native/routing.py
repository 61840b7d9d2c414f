"""DeepSeek-V3's group-limited routing, with a group scored as transformers scores it.

Both choose the ``group_topk`` best of ``num_groups`` expert groups and then the top-k experts inside them. They
differ in a group's score: transformers (DeepSeek-V3, Kimi-K2, GLM-4.5: the checkpoints' own modeling code) sums each
group's two best expert scores; megatron-core 0.16 sums its best ``topk // group_topk``. The two agree where topk is
2 x group_topk (DeepSeek-V3's 8 and 4); elsewhere megatron-core would send tokens to other experts than the model
was trained with. ``install`` puts this function in megatron-core's place.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils


MEGATRON_GROUP_LIMITED_TOPK = moe_utils.group_limited_topk  # what ``install`` replaces
GROUP_SCORE_EXPERTS = 2  # transformers: a group's score is the sum of its two best experts' scores


def group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's ``moe_utils.group_limited_topk`` (same arguments and results) with transformers' group score."""
    per_group = num_experts // num_groups
    group_scores = scores.view(num_tokens, num_groups, per_group).topk(min(GROUP_SCORE_EXPERTS, per_group),
                                                                       dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, per_group).reshape(num_tokens, -1)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)
