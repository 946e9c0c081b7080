"""Local `evaluate` modules (loaded by path with ``evaluate.load``: the hub's metrics need a network)."""
