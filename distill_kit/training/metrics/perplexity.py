"""Held-out perplexity from per-token negative log-likelihoods, as a local `evaluate` module.

The hub's metrics cannot be loaded offline, and its perplexity metric reloads a model by name; this
one takes the NLLs the evaluation loop already computed with the model in memory (sharded or not).
"""

import math

import evaluate

from distill_kit.training import metrics


class Perplexity(evaluate.Metric):
    _info = metrics.info("exp of the mean negative log-likelihood per predicted token",
                         "predictions: the NLL (natural log) of each counted token",
                         predictions="float64")

    def _compute(self, predictions):
        nll = sum(predictions) / max(len(predictions), 1)
        return {"perplexity": math.exp(nll), "nll": nll, "tokens": len(predictions)}
