"""The math, written once. Every function maps rows ``(n, D)`` to a per-row loss ``(n,)``.

For the logit divergences ``D`` is the vocabulary, the inputs are logits already divided by the
temperature, ``p`` is the teacher's distribution ``softmax(teacher_logits)`` and ``q`` the student's.
Everything works on log-probabilities from ``log_softmax``; mixtures of two distributions are formed
in log space with ``logaddexp`` so that no probability is ever logged after underflowing to zero.
Callers upcast to float32 (the chunked path does it per chunk); float64 passes through for tests.

A captured teacher (``distill_kit/offline/store.py``) keeps only its top ``k`` log-probabilities per token;
:func:`top_k_rows` turns those and the student's logits into two rows over the same outcomes, which every
divergence here then takes unchanged: the math of each divergence stays written once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# The log-probability of an outcome that cannot happen. Finite on purpose: 0 * (log 0 - x) must be 0, not nan.
IMPOSSIBLE = -1e30


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs; float64 stays float64 so gradcheck can test every path."""
    return torch.promote_types(dtype, torch.float32)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) = sum_v a (log a - log b), from log-probabilities."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _log_mixture(log_a: torch.Tensor, log_b: torch.Tensor, weight_a: float) -> torch.Tensor:
    """log(w a + (1 - w) b) for 0 < w < 1, stable where either probability underflows."""
    return torch.logaddexp(log_a + math.log(weight_a), log_b + math.log1p(-weight_a))


def mixture_logits(
    teacher_logits: Sequence[torch.Tensor], weights: Sequence[float], temperature: float
) -> torch.Tensor:
    """``T log sum_k w_k softmax(z_k / T)`` for weights summing to 1: logits whose softmax at temperature ``T`` is
    the weighted mixture of the teachers' tempered distributions (so any logit divergence can take it as the
    teacher's). Teachers of weight 0 are left out, which is exact. Float32 (float64 passes through).
    """
    mixed = None
    for logits, weight in zip(teacher_logits, weights, strict=True):
        if weight == 0:
            continue
        term = F.log_softmax(logits.to(compute_dtype(logits.dtype)) / temperature, dim=-1) + math.log(weight)
        mixed = term if mixed is None else torch.logaddexp(mixed, term)
    if mixed is None:
        raise ValueError("a mixture of teachers needs at least one weight > 0")
    return mixed * temperature


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q): mode-covering; the student is pushed to put mass wherever the teacher does."""
    return _kl(F.log_softmax(teacher_logits, dim=-1), F.log_softmax(student_logits, dim=-1))


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(q || p): mode-seeking; the student may drop teacher modes it cannot fit (MiniLLM)."""
    return _kl(F.log_softmax(student_logits, dim=-1), F.log_softmax(teacher_logits, dim=-1))


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q (GKD, Agarwal et al. 2024).

    The formula itself vanishes at both ends (m becomes q or p), so, as in GKD and TRL, ``beta = 0`` is
    defined as forward KL(p || q) and ``beta = 1`` as reverse KL(q || p): the limits of JSD_beta / beta and
    JSD_beta / (1 - beta). They are computed directly, not through the mixture.
    """
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits)
    log_p = F.log_softmax(teacher_logits, dim=-1)
    log_q = F.log_softmax(student_logits, dim=-1)
    log_m = _log_mixture(log_p, log_q, beta)
    return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)


def skew_forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """KL(p || alpha p + (1 - alpha) q), DistiLLM (Ko et al. 2024); bounded where q -> 0. alpha = 0 is KL(p || q)."""
    if alpha == 0.0:
        return forward_kl(student_logits, teacher_logits)
    log_p = F.log_softmax(teacher_logits, dim=-1)
    log_q = F.log_softmax(student_logits, dim=-1)
    return _kl(log_p, _log_mixture(log_p, log_q, alpha))


def skew_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """KL(q || (1 - alpha) p + alpha q), DistiLLM (Ko et al. 2024). alpha = 0 is KL(q || p)."""
    if alpha == 0.0:
        return reverse_kl(student_logits, teacher_logits)
    log_p = F.log_softmax(teacher_logits, dim=-1)
    log_q = F.log_softmax(student_logits, dim=-1)
    return _kl(log_q, _log_mixture(log_q, log_p, alpha))


def total_variation(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """TVD(p, q) = 1/2 sum_v |p - q|, a bounded metric (in [0, 1]) that no single token can blow up."""
    return 0.5 * (F.softmax(teacher_logits, dim=-1) - F.softmax(student_logits, dim=-1)).abs().sum(-1)


def mean_squared_error(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """mean_d (s_d - t_d)^2: on logits (Ba & Caruana 2014) or hidden states (FitNets); a mean, not a sum,
    so the scale does not depend on the vocabulary or hidden width."""
    return (student - teacher).square().mean(-1)


def cosine_distance(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """1 - cos(s, t): matches directions of hidden states and ignores their norms (DistilBERT)."""
    return 1.0 - F.cosine_similarity(student, teacher, dim=-1, eps=1e-8)


def cross_entropy(student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log q(label): the ordinary language-modelling loss on the hard labels; no teacher involved."""
    return F.cross_entropy(student_logits, labels, reduction="none")


def probability_kl(student_probs: torch.Tensor, teacher_probs: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """KL(p || q) between rows that are already probabilities (attention maps, MiniLM).

    Masked entries are exactly 0 in both; clamping the logs at ``eps`` makes them contribute
    ``0 * finite = 0`` with a zero gradient instead of ``0 * -inf = nan``.
    """
    log_p = teacher_probs.clamp_min(eps).log()
    log_q = student_probs.clamp_min(eps).log()
    return (teacher_probs * (log_p - log_q)).sum(-1)


def top_k_rows(
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    ids: torch.Tensor,
    teacher_log_tail: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher rows over a captured teacher's top ``k`` tokens, for any divergence above.

    ``student_logits`` (n, V) and ``teacher_log_probs`` (n, k) are already divided by the temperature;
    ``ids`` (n, k) are the teacher's token ids, where an id >= V (a teacher vocabulary padded past the
    student's) counts as impossible on both sides, as the dense path's vocabulary cut drops it.

    * No tail (``teacher_log_tail`` None): both distributions renormalised over the k ids,
      p~_i = p_i / sum_k p and q~_i = q_i / sum_k q. The rows are the student's logits at the ids and the
      teacher's log-probabilities; a divergence's ``log_softmax`` does the renormalising. The student's
      other logits get no gradient.
    * Tail bucket (``teacher_log_tail`` (n,), log of the teacher's mass outside the k ids, exact only at
      temperature 1): k + 1 outcomes, the ids and "any other token". Both rows are log-probabilities;
      the student's tail is a logsumexp over its other tokens, not ``1 - sum``, so it stays accurate
      when it is far below float32's resolution of 1. With k = V the tail is impossible on both sides.

    Returns ``(student_rows, teacher_rows)``, each (n, k) or (n, k + 1).
    """
    vocab = student_logits.shape[-1]
    missing = ids >= vocab
    teacher = teacher_log_probs.masked_fill(missing, IMPOSSIBLE)
    if teacher_log_tail is None:
        student = student_logits.gather(-1, ids.clamp(max=vocab - 1)).masked_fill(missing, IMPOSSIBLE)
        return student, teacher
    # Column V stands for every id the student lacks: gathering there gives IMPOSSIBLE, and marking it
    # as "in the top k" keeps it out of the student's tail.
    log_q = F.pad(F.log_softmax(student_logits, dim=-1), (0, 1), value=IMPOSSIBLE)  # (n, V + 1)
    index = ids.clamp(max=vocab)
    in_top_k = torch.zeros_like(log_q, dtype=torch.bool).scatter_(-1, index, True)
    student_tail = log_q.masked_fill(in_top_k, IMPOSSIBLE).logsumexp(-1, keepdim=True)
    student = torch.cat([log_q.gather(-1, index), student_tail.clamp(min=IMPOSSIBLE)], dim=-1)
    teacher = torch.cat([teacher, teacher_log_tail.clamp(min=IMPOSSIBLE).unsqueeze(-1)], dim=-1)
    return student, teacher


def sampled_forward_kl(
    student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Forward KL(p || q) estimated from K tokens drawn from p (random-sampling KD, RS-KD: Anshumann et al., ACL 2025).

    ``student_logits`` (n, V) are divided by the temperature T the draws were made at; ``ids`` (n, k) the distinct
    tokens drawn, ``counts`` (n, k) how often each (0 in unused slots), ``teacher_log_probs`` (n, k) their log p at
    T. With ``w_i = c_i / K`` (``E[w_i] = p_i``) the estimate is ``sum_i w_i (log p_i - log q_i)``, ``q`` the
    student's softmax over its *whole* vocabulary: its expectation is ``sum_v p_v (log p_v - log q_v)`` = KL(p || q)
    exactly, and so is its gradient's, ``q - w`` (where top-k's renormalised ``q~ - p~`` is not: it is biased toward
    the head). Only forward KL is linear in p, so only it has this estimator. An id the student lacks (a teacher
    vocabulary padded past it) is left out and the rest renormalised (those ids carry no mass in a trained model).
    """
    vocab = student_logits.shape[-1]
    missing = ids >= vocab
    weights = counts.to(student_logits.dtype).masked_fill(missing, 0.0)
    weights = weights / weights.sum(-1, keepdim=True).clamp(min=1.0)
    log_q = F.log_softmax(student_logits, dim=-1).gather(-1, ids.clamp(max=vocab - 1))
    teacher = teacher_log_probs.to(student_logits.dtype).masked_fill(weights == 0, 0.0)
    return (weights * (teacher - log_q)).sum(-1)


# ---- teacher and student with different tokenizers (losses/cross_tokenizer.py) ---------------------------


def log1mexp(log_a: torch.Tensor) -> torch.Tensor:
    """log(1 - a) from log a <= 0, accurate at both ends (Maechler 2012); log 0 is IMPOSSIBLE, not -inf."""
    log_a = log_a.clamp(max=0.0)
    out = torch.where(log_a > -math.log(2.0), torch.log(-torch.expm1(log_a)), torch.log1p(-torch.exp(log_a)))
    return out.clamp(min=IMPOSSIBLE)


def mapped_rows(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, student_ids: torch.Tensor, teacher_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher rows over the m token pairs of a vocabulary map plus one "unmapped" outcome.

    ``student_logits`` (n, Vs), ``teacher_logits`` (n, Vt) rows that predict the same text; ``student_ids[i]``
    and ``teacher_ids[i]`` (m,) are tokens that stand for the same text. Outcome i is that token; outcome m
    is "a token the other vocabulary has not", with the log of the mass left outside the map on each side.
    Returns log-probability rows (n, m + 1), for any divergence above. When the map covers both vocabularies
    the last outcome is impossible on both sides and adds exactly 0: the divergence of the plain rows.
    """
    log_q = F.log_softmax(student_logits, dim=-1)
    log_p = F.log_softmax(teacher_logits, dim=-1)

    def rows(log_probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        outside = log_probs.index_fill(-1, ids, IMPOSSIBLE).logsumexp(-1, keepdim=True).clamp(min=IMPOSSIBLE)
        return torch.cat([log_probs.index_select(-1, ids), outside], dim=-1)

    return rows(log_q, student_ids), rows(log_p, teacher_ids)


def sorted_l1(student_probs: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """ULD (Boizard et al. 2024): sum_i |q_(i) - p_(i)| over both rows sorted in decreasing order.

    ``student_probs`` (n, a) and ``teacher_probs`` (n, b) are probabilities over outcomes that need not
    correspond; the shorter row is padded with zeros. With rows of total mass 1 this is the closed form of
    the Wasserstein-1 distance between the two distributions of probability values that ULD minimises: it
    compares how confident each side is, whatever the tokens. Zero for two permutations of one row.
    """
    width = max(student_probs.shape[-1], teacher_probs.shape[-1])
    student = F.pad(student_probs.sort(dim=-1, descending=True).values, (0, width - student_probs.shape[-1]))
    teacher = F.pad(teacher_probs.sort(dim=-1, descending=True).values, (0, width - teacher_probs.shape[-1]))
    return (student - teacher).abs().sum(-1)


def exact_token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_ids: torch.Tensor,
    teacher_ids: torch.Tensor,
    student_unmapped: torch.Tensor,
    teacher_unmapped: torch.Tensor,
    bucket: bool = False,
    unmapped_uld_weight: float = 0.0,
) -> torch.Tensor:
    """KL(p || q) over the tokens both vocabularies have, for two rows that predict the same text.

    Where a token of one vocabulary is a token of the other (``student_ids[i]``, ``teacher_ids[i]``), their
    probabilities are of the same event and are compared one to one. The mass on tokens without a counterpart
    (``student_unmapped`` (a,), ``teacher_unmapped`` (b,) ids) is, with ``bucket`` False, left out: both sides
    renormalised over the shared tokens, as :func:`top_k_rows` renormalises over a captured top k. With
    ``bucket`` True it is one more outcome, "a token the other has not" (:func:`mapped_rows`), which pushes the
    two unmapped masses together. ``unmapped_uld_weight`` adds ULD on the unmapped tokens' sorted probabilities
    (GOLD's hybrid, TRL). With one tokenizer on both sides nothing is unmapped: forward KL exactly, either way.
    """
    if bucket:
        student_rows, teacher_rows = mapped_rows(student_logits, teacher_logits, student_ids, teacher_ids)
    else:  # log_softmax over a subset of the logits is the distribution renormalised over that subset
        student_rows, teacher_rows = student_logits.index_select(-1, student_ids), teacher_logits.index_select(
            -1, teacher_ids)
    loss = forward_kl(student_rows, teacher_rows)
    if unmapped_uld_weight and student_unmapped.numel() + teacher_unmapped.numel():
        student_rest = F.softmax(student_logits, dim=-1).index_select(-1, student_unmapped)
        teacher_rest = F.softmax(teacher_logits, dim=-1).index_select(-1, teacher_unmapped)
        loss = loss + unmapped_uld_weight * sorted_l1(student_rest, teacher_rest)
    return loss


def span_divergence(student_logits: torch.Tensor, student_token: torch.Tensor,
                    teacher_span_log_prob: torch.Tensor) -> torch.Tensor:
    """KL between {the student's token, anything else} as the teacher and the student weigh them.

    ``student_logits`` (n, V) predict a student token (``student_token`` (n,)) whose text the teacher splits
    into several tokens; ``teacher_span_log_prob`` (n,) is the teacher's log-probability of that text, the sum
    of its log-probabilities of those tokens (the chain rule: the teacher's probabilities merged to the
    student's segmentation). Only that one outcome is known on the teacher's side, so the comparison is over
    two outcomes; both rows are log-probabilities, the student's "else" a logsumexp of its other logits.
    """
    log_q = F.log_softmax(student_logits, dim=-1)
    token = log_q.gather(-1, student_token.unsqueeze(-1))
    rest = log_q.scatter(-1, student_token.unsqueeze(-1), IMPOSSIBLE).logsumexp(-1, keepdim=True)
    teacher = teacher_span_log_prob.unsqueeze(-1).clamp(IMPOSSIBLE, 0.0)
    student_rows = torch.cat([token, rest.clamp(min=IMPOSSIBLE)], dim=-1)
    teacher_rows = torch.cat([teacher, log1mexp(teacher)], dim=-1)
    return _kl(teacher_rows, student_rows)


def uld(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """ULD on whole rows: :func:`sorted_l1` of ``softmax(student)`` (n, Vs) and ``softmax(teacher)`` (n, Vt)."""
    return sorted_l1(F.softmax(student_logits, dim=-1), F.softmax(teacher_logits, dim=-1))


# ---- policy gradients: the parts of an objective with rewards (losses/policy.py) ----------------------------------

def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """GRPO's sequence advantage: each reward minus its group's mean, divided by the group's standard deviation
    (Bessel-corrected, as TRL's and verl's GRPO take it) plus ``eps`` when ``scale_by_std``. ``rewards`` ``(n,)``
    hold ``n / group_size`` groups of consecutive samples of one prompt. A group whose rewards are all equal gets
    advantage 0 (no signal); without the std scaling (Dr. GRPO) a group's advantages keep the reward's units, so an
    easy prompt whose samples differ little weighs little."""
    groups = rewards.reshape(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def teacher_advantage(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor) -> torch.Tensor:
    """On-policy distillation's per-token advantage, ``log p_teacher(x_t) - log p_student(x_t)`` of each sampled
    token: the k1 estimate of minus the reverse KL at that position (Thinking Machines' on-policy distillation).
    Its mean over the student's samples is minus the reverse KL; the student's term is a constant of the gradient."""
    return teacher_log_probs - student_log_probs.detach()


def clipped_surrogate(log_probs: torch.Tensor, old_log_probs: torch.Tensor | None, advantages: torch.Tensor,
                      clip_low: float, clip_high: float) -> torch.Tensor:
    """PPO's clipped surrogate, as a loss per token: ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` with
    ``r = exp(log_probs - old_log_probs)``, the probability of each sampled token now over when it was sampled.

    ``old_log_probs`` None means the samples came from these very parameters: ``r`` is 1 in value (the sampling
    policy is the current one, detached), the clip never binds, and the gradient is exactly REINFORCE's,
    ``-A grad log p``. Stale samples (sampled before the step's parameters) carry their sampling-time
    log-probabilities, and the clip stops a step from moving a token's probability far past where it was sampled.
    """
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    ratio = torch.exp(log_probs - old)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


# ---- drafters for speculative decoding (losses/drafting.py, distill_kit/training/speculative.py) -------------------

def acceptance_probability(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                           tokens: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) of each drafted token ``tokens`` (n,): the probability that speculative sampling's
    target keeps the drafter's token x (Leviathan et al. 2023). Its mean over x ~ q is sum_x min(p, q) =
    1 - TV(p, q). Computed from log-probabilities, so a q that underflows does not divide by zero."""
    log_p = F.log_softmax(teacher_logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    log_q = F.log_softmax(student_logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return torch.exp((log_p - log_q).clamp(max=0.0))


def verification_weights(acceptance: torch.Tensor, mask: torch.Tensor, gamma: int,
                         rejected_weight: float) -> torch.Tensor:
    """Per-token weights ``(B, T)`` of target-verified rollouts, from each drafted token's acceptance probability
    ``acceptance`` ``(B, T)``; ``mask`` ``(B, T)`` marks a row's drafted tokens, which are cut, in order, into rounds
    of ``gamma``.

    Within a round the target reads a draft only if it kept every earlier one: the weight is the probability of
    reaching the token, prod_{s < t in its round} a_s, times ``1 + rejected_weight * (1 - a_t)``, which puts the loss
    on the tokens the target would reject. The expectation over the coins, not one draw of them: no variance added.
    Zero off the mask.
    """
    index = (mask.long().cumsum(1) - 1).clamp(min=0)  # each drafted token's place in its row's draft
    log_a = torch.log(acceptance.clamp(min=1e-30)) * mask
    before = torch.cumsum(log_a, 1) - log_a  # sum of log a over the row's earlier drafted tokens
    by_index = torch.zeros_like(before).scatter(1, torch.where(mask, index, before.shape[1] - 1), before)
    at_round_start = by_index.gather(1, index - index % gamma)
    reach = torch.exp(before - at_round_start)
    return reach * (1.0 + rejected_weight * (1.0 - acceptance)) * mask
