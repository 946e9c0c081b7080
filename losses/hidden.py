"""Hidden-state losses: chosen student layers regress onto chosen teacher layers (FitNets, TinyBERT).

Indices count as in Hugging Face's ``hidden_states`` tuple: 0 is the embedding output, ``L`` the last
layer. Only positions that count for the logit losses (next label not ``-100``) are compared, and the
sum is divided by the same normaliser, so these terms mix with the others at a consistent scale and do
not change with gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import losses.functional as functional
from losses.base import DistillationLoss, LossOutput, normalizer, valid_positions
from losses.layer_map import check_layer_map, uniform_layer_map


def _hidden_states(output: Any, side: str) -> tuple[torch.Tensor, ...]:
    states = getattr(output, "hidden_states", None)
    if states is None:
        raise ValueError(
            f"the {side} output has no hidden_states; call the model with output_hidden_states=True "
            "(the Distiller does so for a loss with needs_hidden_states)"
        )
    return states


class HiddenStateLoss(DistillationLoss):
    """Base of the hidden-state losses; a subclass writes only :meth:`per_token` on float32 rows.

    The Distiller passes the four model facts below when building the loss (it passes each keyword that
    ``__init__`` accepts); when you build the loss yourself, pass them too.

    Args:
        layers: ``[[student_layer, teacher_layer], ...]``; default: the uniform map, student layer i
            (1..Ls) -> teacher layer floor(i * Lt / Ls), the last onto the last.
        student_num_layers, teacher_num_layers: the models' ``num_hidden_layers``; needed for the
            default map, and used to check an explicit one when the loss is built.
        student_hidden_size, teacher_hidden_size: the models' widths. When they differ, a learned linear
            projection (one, shared by all pairs, as in TinyBERT) maps student states to the teacher's
            width. Its parameters belong to this module: they train with the student's optimizer and are
            saved in checkpoints, and they are not part of the exported student.
    """

    needs_hidden_states = True
    needs_full_logits = False
    takes_teacher_head = True  # reads the teacher's hidden_states, which a headless teacher returns unchanged

    def __init__(
        self,
        layers: Sequence[Sequence[int]] | None = None,
        student_num_layers: int | None = None,
        teacher_num_layers: int | None = None,
        student_hidden_size: int | None = None,
        teacher_hidden_size: int | None = None,
    ):
        super().__init__()
        if layers is None:
            if student_num_layers is None or teacher_num_layers is None:
                raise ValueError(
                    f"{self.name} needs student_num_layers and teacher_num_layers for its default uniform layer "
                    "map, or an explicit 'layers: [[student_layer, teacher_layer], ...]' in the loss config"
                )
            self.layers = uniform_layer_map(student_num_layers, teacher_num_layers)
        elif student_num_layers is not None and teacher_num_layers is not None:
            self.layers = check_layer_map(
                layers, range(student_num_layers + 1), range(teacher_num_layers + 1), "hidden states (0 = embeddings)"
            )
        else:
            self.layers = [(int(s), int(t)) for s, t in layers]
        self.projection = None
        if student_hidden_size is not None and teacher_hidden_size is not None:
            if student_hidden_size != teacher_hidden_size:
                self.projection = nn.Linear(student_hidden_size, teacher_hidden_size)

    def per_token(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """``(n, H)`` float32 (float64 in tests) student (projected) and teacher states -> ``(n,)`` loss per token."""
        raise NotImplementedError

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        student_states, teacher_states = _hidden_states(student, "student"), _hidden_states(teacher, "teacher")
        check_layer_map(
            self.layers, range(len(student_states)), range(len(teacher_states)), "hidden states (0 = embeddings)"
        )
        mask = valid_positions(batch)
        dtype = functional.compute_dtype(student_states[0].dtype)
        total = torch.zeros((), dtype=dtype, device=mask.device)
        for s_index, t_index in self.layers:
            s = student_states[s_index][mask]  # (n, Hs)
            t = teacher_states[t_index][mask].detach().to(dtype)  # (n, Ht)
            if self.projection is not None:
                s = self.projection(s.to(self.projection.weight.dtype))
            if s.shape[-1] != t.shape[-1]:
                raise ValueError(
                    f"student hidden width {s.shape[-1]} != teacher width {t.shape[-1]}: build {self.name} with "
                    "student_hidden_size and teacher_hidden_size so it learns a projection between them"
                )
            total = total + self.per_token(s.to(dtype), t).sum()
        loss = total / len(self.layers) / normalizer(batch, mask)
        return LossOutput(loss, {self.name: loss.detach()})


class HiddenMSE(HiddenStateLoss):
    """Mean squared error between hidden states, mean_h (W s_h + b - t_h)^2, averaged over the layer pairs;
    Romero et al. 2015 "FitNets", Jiao et al. 2020 "TinyBERT".

    Config: ``{name: hidden_mse, layers: [[2, 6], [4, 12]]}`` (omit ``layers`` for the uniform map).
    """

    def per_token(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        return functional.mean_squared_error(student, teacher)


class HiddenCosine(HiddenStateLoss):
    """Cosine distance between hidden states, 1 - cos(W s + b, t), averaged over the layer pairs;
    Sanh et al. 2019 "DistilBERT". Aligns directions and leaves norms free.

    Config: ``{name: hidden_cosine}``.
    """

    def per_token(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        return functional.cosine_distance(student, teacher)
