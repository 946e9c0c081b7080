"""Held-out perplexity from per-token negative log-likelihoods, as a local `evaluate` module.

The hub's metrics cannot be loaded offline, and its perplexity metric reloads a model by name; this
one takes the NLLs the evaluation loop already computed with the model in memory (sharded or not).
"""

import math

import datasets
import evaluate


class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="exp of the mean negative log-likelihood per predicted token",
            citation="",
            inputs_description="predictions: the NLL (natural log) of each counted token",
            features=datasets.Features({"predictions": datasets.Value("float64")}),
        )

    def _compute(self, predictions):
        nll = sum(predictions) / max(len(predictions), 1)
        return {"perplexity": math.exp(nll), "nll": nll, "tokens": len(predictions)}
