"""distill-kit: train a small student language model to imitate a large frozen teacher on DeepSpeed.

Where things live, from the ground floor up: ``errors.py`` and ``config.py`` (every user error and every typed
setting), ``losses/`` (top level), ``engines/`` (DeepSpeed configs, model loading, engine building), ``data/``,
``offline/`` (captured stores), ``students/`` (students cut from a teacher), ``training/`` (the plan, the loop, the
student part, checkpoints, evaluation, export) beside ``teachers/`` (the teacher interface, one file per kind),
``distiller.py`` (the Distiller and its hooks), ``run/`` (the
main job: run config, CLI, report) and ``tasks/`` (seeded task benchmarks with exact checkers).
"""

from distill_kit.config import (
                                AdapterConfig,
                                DeepSpeedSettings,
                                OnPolicyConfig,
                                StudentSpec,
                                TeacherSpec,
                                TrainingConfig,
)
from distill_kit.distiller import Distiller
from distill_kit.offline.captured_teacher import CapturedTeacher
from distill_kit.teachers import Teacher, TeacherCard
from distill_kit.training.plan import DataFacts

__all__ = ["AdapterConfig", "CapturedTeacher", "DataFacts", "DeepSpeedSettings", "Distiller", "OnPolicyConfig",
           "StudentSpec", "Teacher", "TeacherCard", "TeacherSpec", "TrainingConfig"]
