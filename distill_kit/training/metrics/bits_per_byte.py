"""Held-out bits per byte, as a local `evaluate` module: the measure that compares models with different tokenizers.

Perplexity is per token, and a token of one tokenizer is not a token of another; the text is the same for
both. Bits per byte = total negative log-likelihood of the text in bits / its length in UTF-8 bytes
= sum(nll) / (ln 2 * sum(bytes)). An end-of-document token counts as one byte (``alignment.EOS_WIDTH``).
"""

import math

import evaluate

from distill_kit.training import metrics


class BitsPerByte(evaluate.Metric):
    _info = metrics.info("total negative log-likelihood in bits divided by the UTF-8 bytes of the predicted text",
                         "predictions: the NLL (natural log) of each counted token; references: its bytes",
                         predictions="float64", references="int64")

    def _compute(self, predictions, references):
        total_bytes = sum(references)
        return {"bits_per_byte": sum(predictions) / (math.log(2) * total_bytes) if total_bytes else float("nan"),
                "bytes": total_bytes}
