"""Which student layer learns from which teacher layer, for the hidden-state and attention losses.

A layer map is a list of ``(student_index, teacher_index)`` pairs. It is fixed when the loss is built,
because a learned projection per pair must exist before the optimizer is, and because a wrong index
should fail then, with the valid range in the message, not mid-training.
"""

from __future__ import annotations

from collections.abc import Sequence


def uniform_layer_map(student_layers: int, teacher_layers: int) -> list[tuple[int, int]]:
    """Student layer i (1..Ls) -> teacher layer floor(i * Lt / Ls): every k-th teacher layer, last to last.

    For 4 student and 12 teacher layers: (1, 3), (2, 6), (3, 9), (4, 12) (TinyBERT, Jiao et al. 2020).
    """
    return [(i, i * teacher_layers // student_layers) for i in range(1, student_layers + 1)]


def check_layer_map(
    layers: Sequence[Sequence[int]], student_range: range, teacher_range: range, what: str
) -> list[tuple[int, int]]:
    """Validate user pairs against the valid index ranges; ``what`` names them in the error."""
    pairs = []
    for entry in layers:
        if len(entry) != 2:
            raise ValueError(f"layer map entry {list(entry)!r} must be a [student_layer, teacher_layer] pair")
        s, t = int(entry[0]), int(entry[1])
        for side, index, valid in (("student", s, student_range), ("teacher", t, teacher_range)):
            if index not in valid:
                raise ValueError(
                    f"layer map entry [{s}, {t}]: {side} layer {index} is out of range; valid {side} "
                    f"{what} are {valid.start}..{valid.stop - 1}. Fix the 'layers' list in the loss config."
                )
        pairs.append((s, t))
    if not pairs:
        raise ValueError("the layer map is empty; give at least one [student_layer, teacher_layer] pair")
    return pairs
