"""Share of answers a task's exact checker accepts, as a local `evaluate` module."""

import datasets
import evaluate


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="share of generated answers that the task's checker accepts (greedy decoding)",
            citation="",
            inputs_description="predictions: the checker's verdict per prompt; references: True for each prompt",
            features=datasets.Features({"predictions": datasets.Value("bool"), "references": datasets.Value("bool")}),
        )

    def _compute(self, predictions, references):
        right = sum(bool(p) == bool(r) for p, r in zip(predictions, references, strict=True))
        return {"exact_match": right / max(len(predictions), 1)}
