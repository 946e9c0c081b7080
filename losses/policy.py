"""The policy-gradient part of an objective with rewards: one clipped surrogate over the student's own samples.

On-policy distillation mixed with verifiable rewards (MOPD; ms-swift's OPD-RL, verl's distillation with
``use_task_rewards``) gives each sampled token ``x_t`` one advantage made of weighted parts::

    A_t = teacher * (log p_teacher(x_t) - log p_student(x_t))      # on-policy distillation's advantage (k1)
        + reward  * A_seq                                          # the group-normalised reward (GRPO)
        + fixed                                                    # a constant: the no-teacher control

and trains on ``-min(r_t A_t, clip(r_t) A_t)`` (PPO's surrogate; ``r_t`` is 1 for fresh samples). A weight of 0
switches its part off: ``teacher: 0`` is plain GRPO (the teacher is then not run at all), ``reward: 0`` on-policy
distillation through the sampled token, and ``teacher: 0, reward: 0, fixed: -1`` the control of "Does On-Policy
Distillation Really Distill?" (a fixed negative advantage on every sampled token). The dense divergences
(``forward_kl``, ``reverse_kl``, ...) on the same samples join it in a weighted sum::

    loss:
      - {name: reverse_kl, weight: 1.0}                                   # the dense KD part
      - {name: policy_gradient, weight: 1.0, teacher: 1.0, reward: 1.0}   # OPD advantage + reward

Each row's ``A_seq`` comes with the batch (``batch["advantages"]``, made by the run's rewards from its samples:
``distill_kit/training/rewarding.py``); the math is in ``losses/functional.py``. The loss rides the chunked
logit path (``losses/chunked.py``, ``losses/fused.py``), so neither model's full float32 logits ever exist, and
a teacher handing over its head (``HeadOutput``) has it applied chunk by chunk. docs/rewards.md says which
setting the field uses for what.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F

import losses.functional as functional
from losses.base import LogitLoss, LossOutput, next_token_labels, normalizer, valid_positions
from losses.chunked import ChunkLoss
from losses.fused import HeadOutput, logit_loss_sum
from losses.sparse import SparseTeacherLogits

Level = Literal["token", "sequence"]


class PolicyGradient(LogitLoss):
    """``sum_t w_t * -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)`` over the student's sampled tokens.

    Args:
        teacher: weight of the teacher's per-token advantage ``log p_T - log p_S`` (0: the teacher is not read).
        reward: weight of the row's group-normalised reward advantage, ``batch["advantages"]``.
        fixed: a constant advantage added at every sampled token (the control; negative lowers every sample).
        level: ``token`` weighs every sampled token of the step alike (DAPO, Dr. GRPO: a long answer counts for its
            length); ``sequence`` averages each sample's tokens first, then the samples (GRPO as published: each
            answer counts once, so a long wrong answer is penalised per token less than a short one).
        clip_low, clip_high: PPO's clip range around 1 for the probability ratio of stale samples (DAPO raises
            ``clip_high`` to 0.28 to keep exploring); fresh samples have ratio 1 and are never clipped.
    Logs its value and, per step: ``teacher_advantage`` (mean over sampled tokens, minus the k1 reverse KL) when a
    teacher is read, ``entropy`` (the student's mean token entropy, nats), and from the batch's rewards
    ``reward_mean``, ``reward_std``, ``no_signal`` (the share of groups whose rewards are all equal) and
    ``sample_length`` (sampled tokens per row).
    """

    top_k_targets = False  # the sampled token's teacher log-probability: a top-k store may not hold it

    def __init__(self, teacher: float = 1.0, reward: float = 0.0, fixed: float = 0.0, level: Level = "token",
                 clip_low: float = 0.2, clip_high: float = 0.2, chunk_size: int = 1024):
        super().__init__(temperature=1.0, scale_by_t2=False, chunk_size=chunk_size)
        bad = {name: value for name, value in (("teacher", teacher), ("reward", reward), ("fixed", fixed),
                                               ("clip_low", clip_low), ("clip_high", clip_high))
               if not isinstance(value, int | float) or value != value or abs(value) == float("inf")}
        if bad:
            raise ValueError(f"policy_gradient: {bad} must be finite numbers")
        if teacher < 0 or reward < 0:
            raise ValueError(f"policy_gradient: teacher={teacher}, reward={reward}: weights are >= 0 (0 switches "
                             "a part off; a negative weight would train away from the teacher or the reward)")
        if level not in ("token", "sequence"):
            raise ValueError(f"policy_gradient: level {level!r}; choose token or sequence")
        if not (0 <= clip_low < 1 and clip_high >= 0):
            raise ValueError(f"policy_gradient: clip_low={clip_low}, clip_high={clip_high}; give 0 <= clip_low < 1 "
                             "and clip_high >= 0 (0.2 each is PPO's; DAPO raises clip_high to 0.28)")
        self.teacher_weight, self.reward_weight, self.fixed = float(teacher), float(reward), float(fixed)
        self.level, self.clip_low, self.clip_high = level, float(clip_low), float(clip_high)
        self.needs_teacher = self.teacher_weight != 0

    @property
    def name(self) -> str:
        return "policy_gradient"

    @property
    def needs_rewards(self) -> bool:
        """The batch must carry each row's reward advantage (a reward weight > 0)."""
        return self.reward_weight != 0

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        mask = valid_positions(batch)
        rows = mask.reshape(-1).nonzero().squeeze(1)
        labels = next_token_labels(batch).reshape(-1)
        row_advantages = torch.zeros(mask.shape[0], device=mask.device)
        if self.needs_rewards:
            if "advantages" not in batch:
                raise ValueError("policy_gradient with reward > 0 needs each row's reward advantage "
                                 "(batch['advantages']): give the run training.rewards (docs/rewards.md)")
            given = batch["advantages"]  # float32, or float64 (a test's) kept as it is
            row_advantages = self.reward_weight * given.to(mask.device, functional.compute_dtype(given.dtype))
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1).to(row_advantages.dtype)
        if self.level == "sequence":  # each sample's tokens averaged, then the samples of the whole step
            weights = (1.0 / lengths).expand_as(mask)
            divisor = batch.get("sequence_normalizer", (mask.any(dim=1)).sum().clamp(min=1))
        else:
            weights, divisor = torch.ones_like(mask, dtype=row_advantages.dtype), normalizer(batch, mask)
        targets = self._teacher_rows(teacher)
        old = batch.get("old_log_probs")
        chunk = ChunkLoss(policy_rows, (targets[0], labels, row_advantages[:, None].expand_as(mask).reshape(-1),
                                        weights.reshape(-1), None if old is None else old.reshape(-1)),
                          {"teacher_weight": self.teacher_weight, "fixed": self.fixed, "clip_low": self.clip_low,
                           "clip_high": self.clip_high}, targets[1])
        loss = logit_loss_sum(student, rows, chunk, self.chunk_size) / divisor
        return LossOutput(loss, {self.name: loss.detach()} | self.figures(student, targets, mask, labels, batch))

    def _teacher_rows(self, teacher: Any) -> tuple[torch.Tensor | None, tuple[torch.Tensor | None, ...]]:
        """The teacher's flat per-row targets (logits, or hidden states with the head as shared tensors); None when
        its part is off."""
        if not self.needs_teacher:
            return None, ()
        targets = self.teacher_targets(teacher)
        if isinstance(targets, SparseTeacherLogits):
            raise ValueError("policy_gradient with teacher > 0 needs the teacher's log-probability of every sampled "
                             "token, and a top-k teacher (a captured store, a served teacher) may not hold it: use "
                             "an in-process teacher, or teacher: 0 with a dense loss against the top k")
        if isinstance(targets, HeadOutput):
            head = targets.head
            hidden = targets.hidden.reshape(-1, targets.hidden.shape[-1]).detach()
            bias = getattr(head, "bias", None)
            return hidden, (head.weight.detach(), None if bias is None else bias.detach())
        return targets.reshape(-1, targets.shape[-1]).detach(), (None, None)

    @torch.no_grad()
    def figures(self, student: Any, targets: tuple[Any, tuple], mask: torch.Tensor, labels: torch.Tensor,
                batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """What a user watches in a run with rewards, per micro-batch (the loop averages them over the step): the
        student's entropy and the teacher's advantage over the sampled tokens (a pass without gradients each), and
        the rewards' mean, spread, share of groups without signal and the samples' length."""
        rows = mask.reshape(-1).nonzero().squeeze(1)
        count = rows.numel() or 1
        out = {"entropy": logit_loss_sum(student, rows, ChunkLoss(entropy_rows, ()), self.chunk_size) / count}
        if targets[0] is not None:
            chunk = ChunkLoss(advantage_rows, (targets[0], labels), {}, targets[1])
            out["teacher_advantage"] = logit_loss_sum(student, rows, chunk, self.chunk_size) / count
        if "rewards" in batch:
            rewards = batch["rewards"].float()
            out |= {"reward_mean": rewards.mean(), "reward_std": rewards.std(unbiased=False),
                    "no_signal": batch["no_signal"].float().mean()}
        out["sample_length"] = mask.sum(dim=1).float().mean()
        return {k: v.detach().float() for k, v in out.items()}


@torch.no_grad()
def sampled_log_probs(student: Any, batch: Mapping[str, Any], chunk_size: int = 1024) -> torch.Tensor:
    """``(B, T)``: the student's log-probability of each next label (``next_token_labels``), in the loss's compute
    dtype, 0 where none counts; from its logits, or from its hidden states and head (``HeadOutput``) a chunk of
    positions at a time, so the full logits never exist. What a rollout records for its stale steps
    (``old_log_probs``)."""
    mask = valid_positions(batch)
    labels = next_token_labels(batch).reshape(-1)
    rows = mask.reshape(-1).nonzero().squeeze(1)
    if isinstance(student, HeadOutput) and student._logits is None:
        flat, head = student.hidden.reshape(-1, student.hidden.shape[-1]), student.head
    else:
        flat, head = student.logits.reshape(-1, student.logits.shape[-1]), None
    out = torch.zeros(mask.numel(), dtype=functional.compute_dtype(flat.dtype), device=mask.device)
    for start in range(0, rows.numel(), chunk_size):
        chunk = rows[start:start + chunk_size]
        logits = flat[chunk] if head is None else head(flat[chunk])
        out[chunk] = _log_probs(logits.to(out.dtype), labels[chunk])
    return out.reshape(mask.shape)


def _teacher_log_probs(teacher: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """``(c,)`` the teacher's log-probability of each label: its logits given, or made from its hidden states by its
    head (in the teacher's dtype, as the head computes them), cut to the student's vocabulary."""
    logits = teacher if weight is None else F.linear(teacher, weight, bias)
    return _log_probs(logits[:, :vocab].to(dtype), labels)


def _log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(c,)`` log-probability of each row's label under ``(c, V)`` logits."""
    return F.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(1)


def policy_rows(student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor, advantages: torch.Tensor,
                weights: torch.Tensor, old_log_probs: torch.Tensor | None, head_weight: torch.Tensor | None = None,
                head_bias: torch.Tensor | None = None, *, teacher_weight: float, fixed: float, clip_low: float,
                clip_high: float) -> torch.Tensor:
    """One chunk: student ``(c, V)`` float32 logits, the teacher's ``(c, Vt)`` logits or ``(c, H)`` hidden states
    (or None), labels, each token's reward advantage, weight and sampling-time log-probability ``(c,)`` ->
    ``(c,)`` weighted surrogate."""
    log_p = _log_probs(student, labels)
    advantage = advantages + fixed
    if teacher is not None:
        teacher_log_p = _teacher_log_probs(teacher, labels, head_weight, head_bias, student.shape[-1], student.dtype)
        advantage = advantage + teacher_weight * functional.teacher_advantage(teacher_log_p, log_p)
    return weights * functional.clipped_surrogate(log_p, old_log_probs, advantage, clip_low, clip_high)


def entropy_rows(student: torch.Tensor) -> torch.Tensor:
    """``(c,)`` entropy of each row's distribution, in nats."""
    log_q = F.log_softmax(student, dim=-1)
    return -(log_q.exp() * log_q).sum(-1)


def advantage_rows(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
                   head_weight: torch.Tensor | None = None, head_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(c,)`` the teacher's advantage at each sampled token, ``log p_T - log p_S``."""
    log_p = _log_probs(student, labels)
    teacher_log_p = _teacher_log_probs(teacher, labels, head_weight, head_bias, student.shape[-1], student.dtype)
    return functional.teacher_advantage(teacher_log_p, log_p)
