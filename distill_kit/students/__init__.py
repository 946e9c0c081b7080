"""How students are built: cut out of their teacher (layers kept, width pruned by importance)."""

from distill_kit.students.from_teacher import FromTeacherConfig, student_from_teacher

__all__ = ["FromTeacherConfig", "student_from_teacher"]
