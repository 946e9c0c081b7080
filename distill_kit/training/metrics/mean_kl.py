"""Mean KL(p_teacher || q_student) per counted token, as a local `evaluate` module."""

import datasets
import evaluate


class MeanKL(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="mean over counted positions of KL(teacher next-token distribution || student's)",
            citation="",
            inputs_description="predictions: the KL (nats) at each counted token",
            features=datasets.Features({"predictions": datasets.Value("float64")}),
        )

    def _compute(self, predictions):
        return {"mean_kl": sum(predictions) / max(len(predictions), 1)}
