"""Local `evaluate` modules (loaded by path with ``evaluate.load``: the hub's metrics need a network)."""

import datasets
import evaluate


def info(description: str, inputs: str, **features: str):
    """A metric's ``_info``: what it measures, its inputs, and each input's dtype (no citation)."""
    declared = evaluate.MetricInfo(description=description, citation="", inputs_description=inputs,
                                   features=datasets.Features({k: datasets.Value(v) for k, v in features.items()}))
    return lambda self: declared
