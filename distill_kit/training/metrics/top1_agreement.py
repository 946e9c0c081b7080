"""How often the student's most likely next token is the teacher's, as a local `evaluate` module."""

import evaluate

from distill_kit.training import metrics


class Top1Agreement(evaluate.Metric):
    _info = metrics.info("fraction of counted positions where student and teacher argmax tokens agree",
                         "predictions: the student's argmax token ids; references: the teacher's",
                         predictions="int64", references="int64")

    def _compute(self, predictions, references):
        same = sum(int(p == r) for p, r in zip(predictions, references, strict=True))
        return {"top1_agreement": same / max(len(predictions), 1)}
