"""Running sums written out step by step: a seeded task with an exact checker and a character tokenizer.

A prompt is a two-digit start and three one-digit additions or subtractions; the answer writes each
step, then the final value after ``#``::

    prompt:  47+8-3+9
    answer:  47+8=55,55-3=52,52+9=61#61

Why this task: every step is a two-digit +/- one-digit sum (about 1,600 distinct facts, carries and borrows
included), so a model learns it from enough examples and an answer is right only when all three steps are.
A small student trained on a few hundred answers sees each fact about once and memorises answers instead of
learning to add, while its teacher, trained on unlimited data, can answer (sequence-level KD) or score every
token of the student's own attempts (on-policy), mistakes included, for prompts that have no answer: the
regime post-training distillation is for. Three steps keep an answer at 27 tokens, so sampling every step
stays cheap on a CPU (with five, the CPU budget's student did not learn the task even from unlimited answers).
Results stay in 0..99 (an operation that would leave that range is flipped), so every number is at most two
characters. The recipes and how they compare: docs/tasks.md#arithmetic; the figures: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS = 3
SPECIAL = {"pad": "<pad>", "eos": "<|end|>", "user": "<|user|>", "assistant": "<|assistant|>"}
CHARS = list("0123456789+-=,#")
# One user turn, one assistant turn; the {% generation %} markers let the tokenizer mark assistant tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    value: int


def example(rng: random.Random) -> Example:
    total = rng.randint(10, 99)
    prompt, steps = str(total), []
    for _ in range(STEPS):
        digit, op = rng.randint(1, 9), rng.choice("+-")
        if (op == "+" and total + digit > 99) or (op == "-" and total - digit < 0):
            op = "-" if op == "+" else "+"
        result = total + digit if op == "+" else total - digit
        prompt += f"{op}{digit}"
        steps.append(f"{total}{op}{digit}={result}")
        total = result
    return Example(prompt, ",".join(steps) + f"#{total}", total)


def examples(seed: int, count: int | None = None) -> Iterator[Example]:
    """``count`` examples (None: forever) from ``seed``; different seeds give independent streams."""
    return stream(example, seed, count)


def stream(make: Callable[[random.Random], Any], seed: int, count: int | None = None) -> Iterator[Any]:
    """A task's examples: ``make(rng)`` ``count`` times (None: forever) from one generator seeded by ``seed``."""
    rng = random.Random(seed)
    return (make(rng) for _ in (itertools.count() if count is None else range(count)))


def check(prompt: str, completion: str) -> bool:
    """Exact checker: the number after the last ``#`` is the prompt's value (the steps are not graded)."""
    total = int(prompt[:2])
    for i in range(2, len(prompt), 2):
        total = total + int(prompt[i + 1]) if prompt[i] == "+" else total - int(prompt[i + 1])
    final = completion.rsplit("#", 1)
    return len(final) == 2 and final[1].strip() == str(total)


def split_seeds(seed: int) -> dict[str, int]:
    """Disjoint streams for labelled examples, unlabelled prompts, held-out prompts and the teacher's data."""
    return {"labelled": seed * 10 + 1, "prompts": seed * 10 + 2, "heldout": seed * 10 + 3, "teacher": seed * 10 + 4}


def write_jsonl(path: str | Path, items: list[Example], with_answers: bool) -> Path:
    """``prompt``/``completion`` records (the chat data format); prompts alone when ``with_answers`` is False."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for item in items:
            record = {"prompt": item.prompt} | ({"completion": item.answer} if with_answers else {})
            handle.write(json.dumps(record) + "\n")
    return path


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with the chat template: 19 tokens, nothing to download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL.values(), *CHARS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL["pad"]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=SPECIAL["pad"], eos_token=SPECIAL["eos"],
        additional_special_tokens=[SPECIAL["user"], SPECIAL["assistant"]],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def messages(item: Example, with_answer: bool = True) -> list[dict[str, str]]:
    turns = [{"role": "user", "content": item.prompt}]
    return turns + ([{"role": "assistant", "content": item.answer}] if with_answer else [])


def encode(tokenizer, item: Example, with_answer: bool = True) -> tuple[list[int], list[int]]:
    """Token ids and labels of one conversation as the chat template renders it: labels -100 except on the
    answer and its end token; a prompt alone ends with the assistant tag, all -100. Written out by hand (one id
    per character) because it runs for every training example; ``tests/test_on_policy.py`` checks it against
    ``apply_chat_template`` with its assistant mask."""
    vocab = tokenizer.get_vocab()
    prompt = [vocab[SPECIAL["user"]], *(vocab[c] for c in item.prompt), vocab[SPECIAL["assistant"]]]
    if not with_answer:
        return prompt, [-100] * len(prompt)
    answer = [*(vocab[c] for c in item.answer), vocab[SPECIAL["eos"]]]
    return prompt + answer, [-100] * len(prompt) + answer
