"""The main job (scripts/distill.py): run config, CLI, evaluation and metrics, export, report, logs."""
