"""The harness tasks' scoring: each task's own exact checker (``process_results`` of the YAML configs here)."""

from __future__ import annotations

from typing import Any

from distill_kit.tasks import arithmetic as arithmetic_task
from distill_kit.tasks import sorting as sorting_task


def arithmetic(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"exact_match": float(arithmetic_task.check(doc["prompt"], results[0]))}


def sorting(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"exact_match": float(sorting_task.check(doc["prompt"], results[0]))}
