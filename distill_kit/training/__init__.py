"""The one training loop: checkpoints, resume, preemption, non-finite steps, and groups of models."""
