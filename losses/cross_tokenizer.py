"""Distillation between a teacher and a student that do not share a tokenizer: GOLD's hybrid, per aligned span.

The batch holds the same text tokenised by both (``distill_kit/data/paired_blocks.py``) and, per student
position, what its prediction is compared with (``distill_kit/data/alignment.py``). Per kind of span:

* one student token, one teacher token, same text: :func:`losses.functional.exact_token_divergence`,
  KL over the tokens the two vocabularies share (a vocabulary map built once and saved with the run),
  renormalised over them (or, optionally, with the unmapped mass as one more outcome and ULD on its shape);
* one student token over several teacher tokens: the teacher's probabilities merged to the student's
  segmentation by the chain rule, :func:`losses.functional.span_divergence`;
* several student tokens in a span: no teacher probability exists for the pieces, so ULD on whole rows
  (:func:`losses.functional.uld`), against the teacher row that has read no more text than the student.

Why this mix, and the alternatives: docs/losses.md#cross-tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import losses.functional as functional
from losses.base import DistillationLoss, LossOutput, next_token_labels, normalizer, valid_positions
from losses.chunked import chunked_loss
from losses.functional import compute_dtype
from losses.sparse import SparseTeacherLogits

ONE_TO_ONE, MERGE, SPLIT = 1, 2, 3  # distill_kit.data.alignment's align_kind values
PAIRED_KEYS = ("teacher_input_ids", "align_kind", "align_teacher_row", "align_teacher_last")


class CrossTokenizer(DistillationLoss):
    """Teacher and student with different tokenizers: exact-token KL, span merging and ULD (GOLD, TRL; ULD,
    Boizard et al. 2024 "Towards Cross-Tokenizer Distillation: the Universal Logit Distillation Loss").

    With one tokenizer on both sides every span is one token to one, the map covers both vocabularies and the
    loss is forward KL exactly. Config: ``{name: cross_tokenizer, temperature: 1.0, uld_weight: 1.0}``; in a
    run config the vocabulary map is built from the two tokenizers and handed in (the ``vocab_map`` model fact).

    Args:
        vocab_map: a :class:`distill_kit.data.alignment.VocabMap` or the path of one saved as JSON.
        uld_weight: weight of ULD on the rows of split spans, where nothing exact exists, against the KLs.
        unmapped: at one-to-one rows, "renormalise" the shared tokens' probabilities (the default), or "bucket"
            the unmapped mass as one outcome. The bucket asks the student to put on its own tokens that the
            teacher lacks what the teacher puts on its tokens that the student lacks; when one tokenizer is the
            coarser, those are different events (the text of a student-only token is often a teacher token plus
            more), so it is off by default (docs/losses.md#cross-tokenizer).
        unmapped_uld_weight: ULD on the unmapped tokens' sorted probabilities at one-to-one rows (GOLD's hybrid);
            0 by default for the same reason.
        temperature, scale_by_t2, chunk_size: as for every logit loss (:class:`losses.LogitLoss`).
    """

    cross_tokenizer = True

    def __init__(self, vocab_map: Any = None, temperature: float = 1.0, scale_by_t2: bool = True,
                 chunk_size: int = 1024, uld_weight: float = 1.0, unmapped: str = "renormalise",
                 unmapped_uld_weight: float = 0.0):
        super().__init__()
        if vocab_map is None:
            raise ValueError(
                "cross_tokenizer distils across two tokenizers, and no map between their vocabularies was given: in a "
                "run config set student_tokenizer (the students' own tokenizer; the run builds the map), or use a "
                "loss of one vocabulary such as forward_kl; from Python pass Distiller(..., vocab_map=VocabMap.build("
                "student_tokenizer, teacher_tokenizer)) or {name: cross_tokenizer, vocab_map: path.json}"
            )
        if isinstance(vocab_map, str | Path):
            from distill_kit.data.alignment import VocabMap  # the map is a data artefact; only its path is here

            vocab_map = VocabMap.load(vocab_map)
        if temperature <= 0 or chunk_size <= 0 or uld_weight < 0 or unmapped_uld_weight < 0:
            raise ValueError(f"cross_tokenizer: temperature and chunk_size must be > 0, uld_weight and "
                             f"unmapped_uld_weight >= 0; got {temperature}, {chunk_size}, {uld_weight}, "
                             f"{unmapped_uld_weight}")
        if unmapped not in ("renormalise", "bucket"):
            raise ValueError(f"cross_tokenizer: unmapped must be 'renormalise' or 'bucket', got {unmapped!r}")
        self.temperature, self.scale_by_t2 = float(temperature), scale_by_t2
        self.chunk_size, self.uld_weight = int(chunk_size), float(uld_weight)
        self.bucket, self.unmapped_uld_weight = unmapped == "bucket", float(unmapped_uld_weight)
        student_ids, teacher_ids = vocab_map.tensors()
        self.register_buffer("student_ids", student_ids, persistent=False)
        self.register_buffer("teacher_ids", teacher_ids, persistent=False)

    @property
    def name(self) -> str:
        return "cross_tokenizer"

    def span_log_probs(self, teacher_logits: torch.Tensor, batch: Mapping[str, Any],
                       dtype: torch.dtype) -> torch.Tensor:
        """(B, Ts): per MERGE position, the teacher's log-probability (at T) of the span's teacher tokens.

        Only the teacher rows inside some MERGE span are evaluated, in chunks; their sum over a span is a
        difference of cumulative sums, taken in float64 so that long blocks lose no precision.
        """
        kind, first, last = batch["align_kind"], batch["align_teacher_row"], batch["align_teacher_last"]
        n_batch, length, vocab = teacher_logits.shape
        merge = kind == MERGE
        if not merge.any():
            return torch.zeros(kind.shape, dtype=dtype, device=kind.device)
        outside = torch.full_like(first, length + 1)
        starts, stops = torch.where(merge, first, outside), torch.where(merge, last + 1, outside)
        delta = torch.zeros(n_batch, length + 2, dtype=torch.long, device=kind.device)
        delta.scatter_add_(1, starts, torch.ones_like(starts)).scatter_add_(1, stops, -torch.ones_like(stops))
        inside = (delta.cumsum(1)[:, :length] > 0).reshape(-1).nonzero().squeeze(1)
        following = torch.roll(batch["teacher_input_ids"], -1, dims=1).reshape(-1)
        flat = teacher_logits.reshape(-1, vocab)
        log_probs = torch.zeros(n_batch * length, dtype=torch.float64, device=kind.device)
        for chunk in inside.split(self.chunk_size):
            rows = torch.log_softmax(flat[chunk].to(dtype) / self.temperature, dim=-1)
            log_probs[chunk] = rows.gather(1, following[chunk].unsqueeze(1)).squeeze(1).double()
        cumulative = log_probs.reshape(n_batch, length).cumsum(1)
        before = cumulative.gather(1, first) - log_probs.reshape(n_batch, length).gather(1, first)
        return (cumulative.gather(1, last) - before).to(dtype)

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        missing = [key for key in PAIRED_KEYS if key not in batch]
        if missing:
            raise ValueError(f"cross_tokenizer needs paired blocks (the teacher's tokens and the alignment); the batch "
                             f"lacks {missing}. Build the data with distill_kit.data.paired_blocks, or set "
                             "students[].tokenizer in a run config.")
        if isinstance(teacher.logits, SparseTeacherLogits):
            raise ValueError(
                "cross_tokenizer cannot train from a captured teacher: a store keeps the top-k log-probabilities of "
                "each teacher position, but where the student merges teacher tokens this loss needs the teacher's "
                "probability of the token that actually follows (often outside the top k), and its ULD terms need "
                "whole rows. Distil from the live teacher (the store's own tokenizer check refuses the student's)."
            )
        kind = batch["align_kind"]
        mask = valid_positions(batch) & (kind > 0)
        rows = mask.reshape(-1).nonzero().squeeze(1)
        student_logits, teacher_logits = student.logits, teacher.logits.detach()
        dtype = compute_dtype(student_logits.dtype)
        s_vocab, t_vocab = student_logits.shape[-1], teacher_logits.shape[-1]
        t_length = teacher_logits.shape[1]
        offsets = torch.arange(kind.shape[0], device=kind.device).unsqueeze(1) * t_length
        teacher_rows = (offsets + batch["align_teacher_row"]).reshape(-1)
        teacher_flat = teacher_logits.reshape(-1, t_vocab)
        spans = self.span_log_probs(teacher_logits, batch, dtype).reshape(-1)
        following, kinds = next_token_labels(batch).reshape(-1), kind.reshape(-1)
        fits = (self.student_ids < s_vocab) & (self.teacher_ids < t_vocab)  # ids past a model's logits: unmapped
        student_ids, teacher_ids = self.student_ids[fits], self.teacher_ids[fits]
        student_unmapped, teacher_unmapped = _complement(student_ids, s_vocab), _complement(teacher_ids, t_vocab)
        temperature = self.temperature

        def chunk_loss(student_rows: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
            student_rows = student_rows / temperature
            out = student_rows.new_zeros(len(chunk))
            for which in (ONE_TO_ONE, MERGE, SPLIT):
                pick = (kinds[chunk] == which).nonzero().squeeze(1)
                if not pick.numel():
                    continue
                rows_, picked = student_rows[pick], chunk[pick]
                if which == MERGE:
                    value = functional.span_divergence(rows_, following[picked], spans[picked])
                else:
                    teacher = teacher_flat[teacher_rows[picked]].to(student_rows.dtype) / temperature
                    value = (functional.exact_token_divergence(rows_, teacher, student_ids, teacher_ids,
                                                               student_unmapped, teacher_unmapped, self.bucket,
                                                               self.unmapped_uld_weight)
                             if which == ONE_TO_ONE else self.uld_weight * functional.uld(rows_, teacher))
                out = out.index_add(0, pick, value)
            return out

        total = chunked_loss(student_logits.reshape(-1, s_vocab), rows, chunk_loss, self.chunk_size)
        if self.scale_by_t2:
            total = total * temperature**2
        loss = total / normalizer(batch, valid_positions(batch))  # per student token, as cross_entropy
        return LossOutput(loss, {self.name: loss.detach()})


def _complement(ids: torch.Tensor, size: int) -> torch.Tensor:
    """The ids in ``range(size)`` that ``ids`` does not list (a logit row may be padded past the tokenizer)."""
    keep = torch.ones(size, dtype=torch.bool, device=ids.device)
    keep[ids] = False
    return keep.nonzero().squeeze(1)


def teacher_token_problems(loss: DistillationLoss) -> list[str]:
    """Names of the terms of ``loss`` that read the teacher but cannot compare across tokenizers ([] when fine)."""
    terms = getattr(loss, "terms", None)
    if terms is not None:
        return [problem for term in terms.values() for problem in teacher_token_problems(term)]
    if not loss.needs_teacher or getattr(loss, "cross_tokenizer", False):
        return []
    return [loss.name]
