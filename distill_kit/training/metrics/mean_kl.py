"""Mean KL(p_teacher || q_student) per counted token, as a local `evaluate` module."""

import evaluate

from distill_kit.training import metrics


class MeanKL(evaluate.Metric):
    _info = metrics.info("mean over counted positions of KL(teacher next-token distribution || student's)",
                         "predictions: the KL (nats) at each counted token",
                         predictions="float64")

    def _compute(self, predictions):
        return {"mean_kl": sum(predictions) / max(len(predictions), 1)}
