"""Teachers behind one interface (``base.py``): one file per kind (``engine.py``, ``store.py``), which one a spec
names (``kinds.py``), the run's teachers as one part of the step (``group.py``), how several combine (``combine.py``),
and the tokenizer rule every model of a run shares (``tokenizers.py``)."""

from distill_kit.teachers.base import (
                                       ATTENTIONS,
                                       HEAD,
                                       HIDDEN_STATES,
                                       LOGITS,
                                       OUTPUTS,
                                       SAMPLED,
                                       TOP_K,
                                       TOP_K_TAIL,
                                       Teacher,
                                       TeacherCard,
                                       TeacherSetup,
)

__all__ = ["ATTENTIONS", "HEAD", "HIDDEN_STATES", "LOGITS", "OUTPUTS", "SAMPLED", "TOP_K", "TOP_K_TAIL", "Teacher",
           "TeacherCard", "TeacherSetup"]
