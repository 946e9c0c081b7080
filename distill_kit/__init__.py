"""distill-kit: train a small student language model to imitate a large frozen teacher on DeepSpeed.

Where things live, from the ground floor up: ``errors.py`` and ``config.py`` (every user error and every typed
setting), ``losses/`` (top level), ``engines/`` (DeepSpeed configs, model loading, engine building), ``data/``,
``offline/`` (captured teachers), ``students/`` (students cut from a teacher), ``training/`` (the loop, the student
and teacher parts, checkpoints, evaluation, export), ``distiller.py`` (the Distiller and its hooks), ``run/`` (the
main job: run config, CLI, report) and ``tasks/`` (seeded task benchmarks with exact checkers).
"""

from distill_kit.config import AdapterConfig, OnPolicyConfig, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.distiller import Distiller
from distill_kit.offline.captured_teacher import CapturedTeacher

__all__ = ["AdapterConfig", "CapturedTeacher", "Distiller", "OnPolicyConfig", "StudentSpec", "TeacherSpec",
           "TrainingConfig"]
