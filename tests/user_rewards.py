"""Rewards written outside the project, as a user would (imported by path in tests/test_rewards_cli.py)."""

from __future__ import annotations


def matches_answer(prompt: str, completion: str, *, answer: str) -> float:
    """1 when the sample's final value (after '#') is the record's ``answer`` field, else 0."""
    return float(completion.rsplit("#", 1)[-1].strip() == answer)


def needs_reference(prompt: str, completion: str, *, reference: str) -> float:
    return float(completion == reference)


def one_argument(completion: str) -> float:
    return 0.0
