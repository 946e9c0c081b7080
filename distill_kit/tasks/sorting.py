"""Sorting digits: the second shipped task, beside arithmetic, for a teacher per conversation (``combine: route``).

A prompt is eight digits; the answer is the same digits in ascending order::

    prompt:  52819374
    answer:  12345789

Why this task: it shares the arithmetic task's character tokenizer (``arithmetic.build_tokenizer``: the same 19
ids, the same chat template), so its teacher and the arithmetic teacher can score one student's conversations, each
the conversations of its own task; a prompt tells the tasks apart (an arithmetic prompt has ``+`` or ``-`` after its
first two digits, a sorting prompt none). Eight digits give 10^8 prompts, so a student that saw a few hundred
answers has memorised them, while its teacher, trained on unlimited data, sorts any. A tiny teacher learns it on a
CPU in minutes (``scripts/train_task_teacher.py --task sorting``). The checker is exact: the answer must be the
sorted prompt, character for character.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from distill_kit.tasks.arithmetic import build_tokenizer, encode, messages, stream, write_jsonl

__all__ = ["DIGITS", "Example", "build_tokenizer", "check", "encode", "example", "examples", "messages",
           "split_seeds", "write_jsonl"]

DIGITS = 8


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def example(rng: random.Random) -> Example:
    digits = "".join(rng.choice("0123456789") for _ in range(DIGITS))
    return Example(digits, "".join(sorted(digits)))


def examples(seed: int, count: int | None = None) -> Iterator[Example]:
    """``count`` examples (None: forever) from ``seed``; different seeds give independent streams."""
    return stream(example, seed, count)


def check(prompt: str, completion: str) -> bool:
    """Exact checker: the completion (surrounding whitespace aside) is the prompt's digits in ascending order."""
    return completion.strip() == "".join(sorted(prompt))


def split_seeds(seed: int) -> dict[str, int]:
    """Disjoint streams for labelled examples, unlabelled prompts, held-out prompts and the teacher's data; none is
    one of the arithmetic task's streams for any seed (those end in 1..4), so a run of both draws independently."""
    return {"labelled": seed * 10 + 5, "prompts": seed * 10 + 6, "heldout": seed * 10 + 7, "teacher": seed * 10 + 8}
