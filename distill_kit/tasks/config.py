"""The run config's ``task`` section: a task benchmark that compares recipes instead of training students."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RECIPES = ("teacher", "sft", "forward_kl", "seq_kd", "on_policy_reverse_kl", "on_policy_jsd", "mixed")
EXTRA_RECIPES = ("on_policy_forward_kl",)


@dataclass(frozen=True)
class TaskConfig:
    """With ``name`` set, ``scripts/distill.py`` runs the task's comparison (``distill_kit/tasks/compare.py``):
    every recipe from the first student's initial weights and ``training.max_steps`` steps, then greedy
    exact-match accuracy on held-out prompts, into report.json."""

    name: Literal["arithmetic"] | None = None
    """The task; None trains the students on ``data`` as usual."""
    labelled: int = 300
    """Prompts with reference answers: all SFT and off-policy KD see (distillation helps most where answers are few)."""
    prompts: int = 20000
    """Prompts without answers: what sequence-level KD and on-policy distillation learn from (the teacher answers)."""
    heldout: int = 500
    """Held-out prompts for greedy exact-match accuracy and the teacher-student KL on their answers."""
    warm_start_steps: int = 100
    """SFT steps on the labelled answers before the on-policy recipes (part of their max_steps): a random student's
    samples are noise the teacher cannot correct (GKD; measured: on-policy from scratch learns nothing)."""
    recipes: tuple[str, ...] = RECIPES
    """Which rows to run, of: teacher, sft, forward_kl, seq_kd, on_policy_reverse_kl, on_policy_jsd, mixed, and
    on_policy_forward_kl (GKD's on-policy forward KL; not in the issue's table, so not run by default)."""
    max_new_tokens: int = 32
    """Longest answer sampled in training or generated in evaluation (the task's answers are 27 tokens)."""

    def __post_init__(self) -> None:
        unknown = [r for r in self.recipes if r not in RECIPES + EXTRA_RECIPES]
        if unknown:
            raise ValueError(f"task.recipes: unknown {unknown}; choose from {list(RECIPES + EXTRA_RECIPES)}")
        if min(self.labelled, self.prompts, self.heldout) < 1 or self.warm_start_steps < 0:
            raise ValueError("task.labelled, task.prompts and task.heldout must be >= 1, warm_start_steps >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens: {self.max_new_tokens} tokens leaves no answer to sample or "
                             "generate; give 1 or more (the task's answers are 27 tokens)")
