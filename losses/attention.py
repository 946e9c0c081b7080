"""Attention-map transfer: the student's attention distributions imitate the teacher's (MiniLM).

Hugging Face models return attentions only with eager attention (``attn_implementation="eager"``); the
SDPA and flash kernels never build the (heads, T, T) maps. Indices count as in the ``attentions`` tuple:
0 is the first layer, ``L - 1`` the last.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

import losses.functional as functional
from losses.base import DistillationLoss, LossOutput, normalizer, valid_positions
from losses.layer_map import check_layer_map


def _attentions(output: Any, side: str) -> tuple[torch.Tensor, ...]:
    maps = getattr(output, "attentions", None)
    if maps is None or any(m is None for m in maps):
        raise ValueError(
            f"the {side} output has no attentions; load the model with attn_implementation='eager' and call it "
            "with output_attentions=True (the Distiller does the latter for a loss with needs_attentions)"
        )
    return maps


class AttentionKL(DistillationLoss):
    """KL between teacher and student self-attention distributions, Wang et al. 2020 "MiniLM":
    mean over heads of KL(A_t[h, i, :] || A_s[h, i, :]) for each counted query position i, averaged over
    the layer pairs. Student and teacher need the same number of heads (the maps are compared head by
    head); the sequence dimension is shared, so widths and depths may differ.

    The Distiller passes ``student_num_layers`` / ``teacher_num_layers`` when building the loss (it
    passes each keyword that ``__init__`` accepts); when you build the loss yourself, pass them too.

    Args:
        layers: ``[[student_layer, teacher_layer], ...]``; default: last layer onto last layer, as in
            MiniLM, which found that transferring the last layer alone suffices.
        student_num_layers, teacher_num_layers: the models' ``num_hidden_layers``.

    Config: ``{name: attention_kl}`` or ``{name: attention_kl, layers: [[5, 11], [2, 5]]}``.
    """

    needs_attentions = True
    needs_full_logits = False
    takes_teacher_head = True  # reads the teacher's attentions, which a headless teacher returns unchanged

    def __init__(
        self,
        layers: Sequence[Sequence[int]] | None = None,
        student_num_layers: int | None = None,
        teacher_num_layers: int | None = None,
    ):
        super().__init__()
        known = student_num_layers is not None and teacher_num_layers is not None
        if layers is None:
            if not known:
                raise ValueError(
                    "attention_kl needs student_num_layers and teacher_num_layers for its default (last layer onto "
                    "last layer), or an explicit 'layers: [[student_layer, teacher_layer], ...]' in the loss config"
                )
            layers = [(student_num_layers - 1, teacher_num_layers - 1)]
        if known:
            self.layers = check_layer_map(layers, range(student_num_layers), range(teacher_num_layers), "attentions")
        else:
            self.layers = [(int(s), int(t)) for s, t in layers]

    def forward(self, student: Any, teacher: Any, batch: Mapping[str, Any]) -> LossOutput:
        student_maps, teacher_maps = _attentions(student, "student"), _attentions(teacher, "teacher")
        check_layer_map(self.layers, range(len(student_maps)), range(len(teacher_maps)), "attentions")
        mask = valid_positions(batch)
        dtype = functional.compute_dtype(student_maps[0].dtype)
        total = torch.zeros((), dtype=dtype, device=mask.device)
        for s_index, t_index in self.layers:
            s, t = student_maps[s_index], teacher_maps[t_index]  # (B, heads, T, T)
            if s.shape[1] != t.shape[1]:
                raise ValueError(
                    f"attention layer pair [{s_index}, {t_index}]: student has {s.shape[1]} heads, teacher "
                    f"{t.shape[1]}; attention_kl compares heads one to one, so use a teacher and student with "
                    "equal head counts or drop attention_kl from the loss config"
                )
            s_rows = s.transpose(1, 2)[mask].to(dtype)  # (n, heads, T): counted query positions
            t_rows = t.detach().transpose(1, 2)[mask].to(dtype)
            total = total + functional.probability_kl(s_rows, t_rows).mean(-1).sum()
        loss = total / len(self.layers) / normalizer(batch, mask)
        return LossOutput(loss, {self.name: loss.detach()})
