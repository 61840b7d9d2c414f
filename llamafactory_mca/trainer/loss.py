"""Losses as Megatron's schedule wants them: ``(loss, num_tokens, logged)`` per micro-batch.

We run Megatron with ``calculate_per_token_loss``: each micro-batch returns the *sum* of its token
losses and its number of loss tokens; Megatron all-reduces the token count over data and context
parallel ranks and divides the gradients by it. The step's loss is therefore
Σ token losses / Σ loss tokens over the whole global batch — independent of the layout and of how
rows were packed.

DPO losses follow LLaMA-Factory's (sigmoid with label smoothing, hinge, ipo, orpo, simpo, pref_ftx), and so does KTO's.
A pair's log-probabilities are sums over its sequence, all-reduced over context-parallel ranks.

The reward model's loss is LLaMA-Factory's PairwiseTrainer's: -logsigmoid(chosen score - rejected score), a pair's
scores read at the last token of each sequence (the one target ``data/rows.py`` gives a reward model's sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from torch.distributed.nn.functional import all_reduce


def lm_loss(loss_mask: torch.Tensor, token_losses: torch.Tensor):
    mask = loss_mask.float()
    total = (token_losses.float() * mask).sum()
    count = mask.sum()
    return total, count.to(torch.int), {"loss": torch.stack([total.detach(), count.detach()])}


def sequence_logps(token_losses: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ log p, number of loss tokens) per sequence, all-reduced over context parallel ranks."""
    logp = -token_losses.float() * loss_mask.float()
    sums = torch.zeros(num_seqs, dtype=torch.float32, device=logp.device).index_add(0, seq_ids.reshape(-1),
                                                                                     logp.reshape(-1))
    counts = torch.zeros(num_seqs, dtype=torch.float32, device=logp.device).index_add(
        0, seq_ids.reshape(-1), loss_mask.float().reshape(-1))
    if ps.get_context_parallel_world_size() > 1:
        group = ps.get_context_parallel_group()
        sums = all_reduce(sums, group=group)
        counts = all_reduce(counts.detach(), group=group)
    return sums, counts


@dataclass
class PreferenceConfig:
    """DPO's loss (``pref_loss``) or KTO's (``loss="kto"``) and their settings, as LLaMA-Factory names them."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    ftx: float = 0.0
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0  # KTO: kto_chosen_weight
    undesirable_weight: float = 1.0  # KTO: kto_rejected_weight

    SUPPORTED = ("sigmoid", "hinge", "ipo", "orpo", "simpo")  # DPO's pref_loss values

    @property
    def needs_reference(self) -> bool:
        return self.loss not in ("orpo", "simpo")

    @property
    def average_logps(self) -> bool:
        """LLaMA-Factory averages log-probs over tokens for ipo, orpo and simpo."""
        return self.loss in ("ipo", "orpo", "simpo")


def preference_losses(cfg: PreferenceConfig, chosen: torch.Tensor, rejected: torch.Tensor,
                      ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None,
                      chosen_avg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and (chosen, rejected) rewards."""
    if cfg.loss == "orpo":
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        losses = -chosen + cfg.beta * -F.logsigmoid(log_odds)
        return losses, cfg.beta * chosen.detach(), cfg.beta * rejected.detach()
    if cfg.loss == "simpo":
        logits = (chosen - rejected) - cfg.simpo_gamma / cfg.beta
        losses = -F.logsigmoid(cfg.beta * logits)
        rewards = cfg.beta * chosen.detach(), cfg.beta * rejected.detach()
    else:
        logits = (chosen - rejected) - (ref_chosen - ref_rejected)
        if cfg.loss == "sigmoid":
            losses = (-F.logsigmoid(cfg.beta * logits) * (1 - cfg.label_smoothing)
                      - F.logsigmoid(-cfg.beta * logits) * cfg.label_smoothing)
        elif cfg.loss == "hinge":
            losses = torch.relu(1 - cfg.beta * logits)
        else:  # ipo
            losses = (logits - 1 / (2 * cfg.beta)) ** 2
        rewards = cfg.beta * (chosen - ref_chosen).detach(), cfg.beta * (rejected - ref_rejected).detach()
    if cfg.ftx > 0:
        losses = losses + cfg.ftx * -chosen_avg
    return losses, rewards[0], rewards[1]


def pair_logps(cfg: PreferenceConfig, batch, token_losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probs per pair, summed or averaged over tokens as the loss kind wants."""
    sums, counts = sequence_logps(token_losses, batch.loss_mask, batch.seq_ids, 2 * batch.num_pairs)
    logps = sums / counts.clamp(min=1) if cfg.average_logps else sums
    return logps[0::2], logps[1::2]


def collect_pair_logps(cfg: PreferenceConfig, batch, token_losses: torch.Tensor):
    """A forward-only 'loss' that hands back the reference log-probs of a micro-batch's pairs."""
    chosen, rejected = pair_logps(cfg, batch, token_losses)
    zero = token_losses.sum() * 0.0
    return zero, torch.tensor(0, dtype=torch.int, device=zero.device), {"_pairs": torch.stack([chosen, rejected], 1)}


def dpo_loss(cfg: PreferenceConfig, batch, token_losses: torch.Tensor):
    """Megatron loss function for a micro-batch of preference pairs (sequence 2i chosen, 2i+1 rejected)."""
    sums, counts = sequence_logps(token_losses, batch.loss_mask, batch.seq_ids, 2 * batch.num_pairs)
    averages = sums / counts.clamp(min=1)
    logps = averages if cfg.average_logps else sums
    chosen, rejected = logps[0::2], logps[1::2]
    ref_chosen = ref_rejected = None
    if cfg.needs_reference:
        ref_chosen, ref_rejected = batch.ref_chosen_logps.float(), batch.ref_rejected_logps.float()
    losses, chosen_rewards, rejected_rewards = preference_losses(cfg, chosen, rejected, ref_chosen, ref_rejected,
                                                                 averages[0::2])
    return _pair_outputs(losses, counts, lambda valid: {
        "rewards/chosen": (chosen_rewards * valid).sum(),
        "rewards/rejected": (rejected_rewards * valid).sum(),
        "rewards/accuracies": ((chosen_rewards > rejected_rewards).float() * valid).sum(),
        "rewards/margins": ((chosen_rewards - rejected_rewards) * valid).sum(),
        "logps/chosen": (chosen.detach() * valid).sum(),
        "logps/rejected": (rejected.detach() * valid).sum(),
    })


def preference_loss(cfg: PreferenceConfig, batch, token_losses: torch.Tensor):
    """Megatron loss function for a micro-batch of preference pairs or KTO rows."""
    return (kto_loss if cfg.loss == "kto" else dpo_loss)(cfg, batch, token_losses)


def kto_loss(cfg: PreferenceConfig, batch, token_losses: torch.Tensor):
    """Megatron loss function for a micro-batch of KTO rows (sequence 2i a row's answer, 2i + 1 its KL sample: its
    prompt with another row's answer), as LLaMA-Factory's KTO (trl's) computes it. The KL estimate is the mean of
    policy minus reference log-probs over the KL samples of the data-parallel ranks' current micro-batches (trl: each
    process's micro-batch mean, averaged over processes), detached, at least 0; the KL samples train nothing."""
    sums, counts = sequence_logps(token_losses, batch.loss_mask, batch.seq_ids, 2 * batch.num_pairs)
    valid = ((counts[0::2] > 0) & (counts[1::2] > 0)).float()
    logps = sums[0::2]
    ratios = logps - batch.ref_chosen_logps.float()
    kl = _data_parallel_mean((sums[1::2].detach() - batch.ref_rejected_logps.float()) * valid, valid).clamp(min=0)
    good = batch.desirable.float()
    losses = (good * cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * (ratios - kl)))
              + (1 - good) * cfg.undesirable_weight * (1 - torch.sigmoid(cfg.beta * (kl - ratios))))
    chosen, rejected = good * valid, (1 - good) * valid
    if cfg.ftx > 0:
        # LLaMA-Factory adds pref_ftx x the chosen rows' mean -log p per token, scaled by rows / chosen rows, to the
        # micro-batch's mean loss: per row, x rows / chosen rows twice
        scale = (valid.sum() / chosen.sum().clamp(min=1)) ** 2
        losses = losses + chosen * cfg.ftx * scale * -(logps / counts[0::2].clamp(min=1))
    rewards = cfg.beta * ratios.detach()
    return _pair_outputs(losses, counts, lambda valid: {
        "rewards/chosen": ((rewards * chosen).sum(), chosen.sum()),
        "rewards/rejected": ((rewards * rejected).sum(), rejected.sum()),
        "logps/chosen": ((logps.detach() * chosen).sum(), chosen.sum()),
        "logps/rejected": ((logps.detach() * rejected).sum(), rejected.sum()),
        "kl": (kl, torch.ones_like(kl)),
    })


def _data_parallel_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ values / Σ weights over this micro-batch and the data-parallel ranks' (each runs its k-th micro-batch now,
    stand-ins included, so the collective pairs up), without gradient."""
    totals = torch.stack([values.detach().sum(), weights.sum()])
    if ps.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(totals, group=ps.get_data_parallel_group())
    return totals[0] / totals[1].clamp(min=1)


def reward_loss(batch, values: torch.Tensor):
    """Megatron loss function for a reward model's micro-batch of pairs: ``values`` [b, s] from the value head, each
    sequence scored at its one loss-mask position. Its accuracy (the share of pairs whose chosen answer scores higher,
    LLaMA-Factory's rm metric) is logged under DPO's name, which LLaMA-Factory's trainer_log.jsonl writes as
    ``accuracy``."""
    scores, counts = sequence_logps(-values, batch.loss_mask, batch.seq_ids, 2 * batch.num_pairs)
    chosen, rejected = scores[0::2], scores[1::2]
    losses = -F.logsigmoid(chosen - rejected)
    return _pair_outputs(losses, counts, lambda valid: {
        "rewards/accuracies": ((chosen > rejected).float() * valid).sum(),
    })


def _pair_outputs(losses: torch.Tensor, counts: torch.Tensor, metrics):
    """(loss sum, pair count, logged) from per-pair losses; ``metrics(valid)``: the logged sums besides the loss."""
    # A real pair has targets on both sides; the rows that fill a short micro-batch and the stand-ins that keep
    # ranks in step have none, and must add nothing.
    valid = ((counts[0::2] > 0) & (counts[1::2] > 0)).float()
    cp = ps.get_context_parallel_world_size()
    # Every CP rank computes the same pair losses; count the pairs once so Megatron's dp·cp all-reduce of the
    # count is right, and scale so the gradients summed over CP ranks are those of one copy.
    n = valid.sum()
    count = (n if ps.get_context_parallel_rank() == 0 else n * 0).to(torch.int)
    total = (losses * valid).sum() / cp
    sums_logged = {"loss": (losses * valid).sum().detach(), **metrics(valid)}
    # [sum, count], averaged later; a metric of some pairs only (KTO's chosen rows) brings its own count
    logged = {k: torch.stack([t.detach().float() for t in (v if isinstance(v, tuple) else (v, n))])
              for k, v in sums_logged.items()}
    if cp > 1 and ps.get_context_parallel_rank() != 0:
        logged = {k: torch.zeros_like(v) for k, v in logged.items()}
    return total, count, logged
