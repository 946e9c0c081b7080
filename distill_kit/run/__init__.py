"""The main job (scripts/distill.py): run config, CLI, task benchmarks, evaluation, metrics, export, report, logs."""
