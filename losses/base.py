"""What every distillation loss is: ``(student outputs, teacher outputs, batch) -> LossOutput``.

Token selection and normalisation live here, once, so that no loss can get them wrong:

* Position ``t`` of a causal LM predicts token ``t + 1``; a position counts when the next label is not
  ``-100`` (padding and prompt tokens are marked that way by the data pipeline).
* A loss is a *sum* over counted positions divided by ``batch["loss_normalizer"]``. The training loop sets
  that to (valid tokens in the whole optimizer step, over all micro-batches and ranks) divided by
  (micro-batches x ranks), which cancels DeepSpeed's mean over micro-batches and ranks. The result is
  the per-token mean over the whole accumulated batch, whatever the micro-batch size or accumulation.
  Without a normaliser (a loss called on its own) it is the per-token mean of this batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from losses.chunked import ChunkLoss, dense_chunk_loss, head_chunk_loss
from losses.fused import HeadOutput, logit_loss_sum
from losses.sparse import SampledTeacherLogits, SparseTeacherLogits, sampled_chunk_loss, top_k_chunk_loss

IGNORE_INDEX = -100


@dataclass
class LossOutput:
    """``total`` is what the student backpropagates; ``parts`` are detached named terms to log."""

    total: torch.Tensor
    parts: dict[str, torch.Tensor] = field(default_factory=dict)


def valid_positions(batch: Mapping[str, Any]) -> torch.Tensor:
    """Bool ``(B, T)``: positions whose prediction of the next token counts. The last never does."""
    labels = batch.get("labels")
    if labels is None:
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


def next_token_labels(batch: Mapping[str, Any]) -> torch.Tensor:
    """``(B, T)`` labels aligned with the logits that predict them (the last column is ignored)."""
    labels = batch.get("labels", batch["input_ids"])
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def normalizer(batch: Mapping[str, Any], mask: torch.Tensor) -> torch.Tensor | float:
    """The divisor that turns a token sum into the per-token mean of the whole optimizer step."""
    given = batch.get("loss_normalizer")
    if given is not None:
        return given
    return mask.sum().clamp(min=1)


class DistillationLoss(nn.Module):
    """Base of every loss. Subclasses say what they need, so the Distiller asks the models for no more.

    Hidden states and attention maps cost memory on both models, so they are requested only when a loss
    sets ``needs_hidden_states`` / ``needs_attentions``.
    """

    needs_hidden_states: bool = False
    needs_attentions: bool = False
    needs_full_logits: bool = True
    """Whether the loss reads the student's full ``logits``. When no term does, the Distiller runs the student
    without its output head and logit losses compute the logits chunk by chunk with the loss (``losses/fused.py``);
    a loss that reads ``logits`` anyway still gets them, computed in full. User losses are assumed to need them."""
    needs_teacher: bool = True
    """False when the teacher slot is never read as a teacher's outputs (cross-entropy on the labels; mutual
    learning, which reads peers there): only such losses train models that have no teacher."""
    takes_teacher_head: bool = False
    """Whether the loss, given a teacher's :class:`~losses.fused.HeadOutput` (final hidden states and output head,
    no logits), never builds the teacher's full logits: a logit loss applies the head chunk by chunk next to the
    student's rows, and a loss that reads no teacher logits (hidden states, attentions, labels) never applies it.
    When every loss against a teacher does, the teacher may run without its head
    (``distill_kit/engines/head.py``). A loss without it still works on a ``HeadOutput``, whose ``logits`` are then
    computed in full on first read; user losses are assumed to read them."""

    @property
    def name(self) -> str:
        """The key of this loss's value in ``LossOutput.parts`` when it is used on its own."""
        return type(self).__name__

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        raise NotImplementedError


class LogitLoss(DistillationLoss):
    """A per-token divergence between student and teacher next-token distributions.

    Subclasses write only :meth:`per_token` on float32 rows; this class selects the counted positions,
    cuts a teacher vocabulary padded past the student's (e.g. 152064 vs 151936), applies the temperature
    and its ``T**2`` gradient scale (Hinton et al. 2015; switch off with ``scale_by_t2=False``), works in
    chunks of ``chunk_size`` tokens so that no full float32 copy of the logits exists (``losses/chunked.py``:
    the gradient is made per chunk in forward), and normalises.

    The teacher's ``logits`` may also be a captured teacher's top-k targets (:class:`SparseTeacherLogits`);
    then ``per_token`` gets rows over the k ids (``losses/sparse.py``), unless ``top_k_targets`` is False.

    The student's outputs may be a :class:`~losses.fused.HeadOutput` (hidden states and the output head):
    then the logits are computed chunk by chunk with the loss and never exist in full (``losses/fused.py``).
    So may the teacher's (``takes_teacher_head``): then each chunk's teacher logits are computed from the
    teacher's hidden states next to the student's chunk (``losses/chunked.py:head_chunk_loss``). A subclass that
    overrides :meth:`chunk_loss` and reads the teacher's logits itself sets ``takes_teacher_head = False``.
    """

    needs_full_logits = False
    takes_teacher_head = True

    top_k_targets: bool = True
    """Whether ``per_token`` means the same on rows over a captured teacher's top k (any divergence does)."""
    sampled_targets: bool = False
    """Whether the loss is forward KL, the one divergence with an unbiased estimate from tokens sampled from the
    teacher (a sampled store: :func:`losses.functional.sampled_forward_kl`)."""

    def __init__(self, temperature: float = 1.0, scale_by_t2: bool = True, chunk_size: int = 1024):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
        self.temperature = float(temperature)
        self.scale_by_t2 = scale_by_t2
        self.chunk_size = int(chunk_size)

    def per_token(
        self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """``(n, V)`` float32 logits already divided by T, ``(n,)`` labels -> ``(n,)`` loss per token."""
        raise NotImplementedError

    def chunk_loss(self, teacher_logits: Any, labels: torch.Tensor) -> ChunkLoss:
        """What each chunk of student rows is compared with: a live teacher's logits, a live teacher's hidden states
        and head (a :class:`~losses.fused.HeadOutput` whose logits were never built), or a captured top k."""
        if isinstance(teacher_logits, HeadOutput):
            head = teacher_logits.head
            hidden = teacher_logits.hidden.reshape(-1, teacher_logits.hidden.shape[-1])
            return head_chunk_loss(self.per_token, hidden, head.weight, getattr(head, "bias", None), labels,
                                   self.temperature)
        if isinstance(teacher_logits, SampledTeacherLogits):
            if not self.sampled_targets:
                raise ValueError(
                    f"{self.name} cannot use a sampled teacher store: only forward KL is linear in the teacher's "
                    "distribution, so only it has an unbiased estimate from sampled tokens. Use forward_kl, or a top-k "
                    "store (any divergence), or the served teacher's payload: hidden (the exact distribution)."
                )
            return sampled_chunk_loss(teacher_logits, self.temperature, self.name)
        if not isinstance(teacher_logits, SparseTeacherLogits):
            return dense_chunk_loss(self.per_token, teacher_logits.reshape(-1, teacher_logits.shape[-1]), labels,
                                    self.temperature)
        if not self.top_k_targets:
            raise ValueError(
                f"{self.name} cannot use a captured teacher: it needs the teacher's full logits, and the store keeps "
                "only the top-k log-probabilities. Use a divergence (forward_kl, reverse_kl, generalized_jsd, ...) "
                "or distil from the live teacher."
            )
        return top_k_chunk_loss(self.per_token, teacher_logits, labels, self.temperature, self.name)

    def teacher_targets(self, teacher: Any) -> Any:
        """The teacher's ``HeadOutput`` itself when its logits were never built and this loss takes it (the head is
        then applied per chunk); its ``logits`` otherwise (built in full on first read, and reused once built)."""
        if self.takes_teacher_head and isinstance(teacher, HeadOutput) and teacher._logits is None:
            return teacher
        return teacher.logits

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        mask = valid_positions(batch)
        rows = mask.reshape(-1).nonzero().squeeze(1)
        chunk_loss = self.chunk_loss(self.teacher_targets(teacher), next_token_labels(batch).reshape(-1))
        total = logit_loss_sum(student, rows, chunk_loss, self.chunk_size)
        if self.scale_by_t2:
            total = total * self.temperature**2
        loss = total / normalizer(batch, mask)
        return LossOutput(loss, {self.name: loss.detach()})
