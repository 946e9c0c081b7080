"""Share of answers a task's exact checker accepts, as a local `evaluate` module."""

import evaluate

from distill_kit.training import metrics


class ExactMatch(evaluate.Metric):
    _info = metrics.info("share of generated answers that the task's checker accepts (greedy decoding)",
                         "predictions: the checker's verdict per prompt; references: True for each prompt",
                         predictions="bool", references="bool")

    def _compute(self, predictions, references):
        right = sum(bool(p) == bool(r) for p, r in zip(predictions, references, strict=True))
        return {"exact_match": right / max(len(predictions), 1)}
