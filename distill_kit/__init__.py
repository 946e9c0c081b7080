"""distill-kit: train a small student language model to imitate a large frozen teacher on DeepSpeed.

Where things live: ``distiller.py`` (the Distiller and its hooks), ``engines/`` (DeepSpeed configs,
model loading, engine building), ``training/`` (the loop, checkpoints, groups of models), ``data/``,
``offline/`` (captured teachers), ``run/`` (the main job: config, CLI, evaluation, export, report) and
``tasks/`` (seeded task benchmarks with exact checkers).
"""

from distill_kit.distiller import Distiller
from distill_kit.engines.peft_student import AdapterConfig
from distill_kit.offline.captured_teacher import CapturedTeacher
from distill_kit.training.config import TrainingConfig
from distill_kit.training.multi_student import MultiStudentDistiller
from distill_kit.training.on_policy import OnPolicyConfig
from distill_kit.training.side_by_side import SideBySide
from distill_kit.training.student_spec import StudentSpec
from distill_kit.training.teachers import MultiTeacherDistiller, TeacherSpec

__all__ = ["AdapterConfig", "CapturedTeacher", "Distiller", "MultiStudentDistiller", "MultiTeacherDistiller",
           "OnPolicyConfig", "SideBySide", "StudentSpec", "TeacherSpec", "TrainingConfig"]
