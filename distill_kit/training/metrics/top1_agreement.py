"""How often the student's most likely next token is the teacher's, as a local `evaluate` module."""

import datasets
import evaluate


class Top1Agreement(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="fraction of counted positions where student and teacher argmax tokens agree",
            citation="",
            inputs_description="predictions: the student's argmax token ids; references: the teacher's",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        same = sum(int(p == r) for p, r in zip(predictions, references, strict=True))
        return {"top1_agreement": same / max(len(predictions), 1)}
