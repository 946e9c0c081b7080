"""A run whose students have their own tokenizer: the tokenizer, the vocabulary map and the paired blocks.

Set ``student_tokenizer`` in the run config and the run distils across tokenizers: every text is tokenised
by both (``distill_kit/data/paired_blocks.py``), the teacher reads its own tokens, the losses that read the
teacher must be ``cross_tokenizer`` (others compare token ids, which now mean different text), and the report
gives bits per byte. The vocabulary map is built once per start from the two tokenizers and written to
``<output_dir>/vocab_map.json`` once the run has claimed its folder (the same tokenizers give the same map).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from distill_kit.data import blocks
from distill_kit.data.alignment import VocabMap
from distill_kit.data.paired_blocks import tokenize_to_paired_blocks
from distill_kit.data.tokenizer import train_tokenizer
from distill_kit.engines import distributed
from distill_kit.run.run_config import ConfigError, RunConfig
from losses.registry import resolve

TRAINED_PREFIX = "bpe:"


@dataclass(frozen=True)
class StudentTokenizer:
    """What a cross-tokenizer run adds: the students' tokenizer, the map, and how blocks are made."""

    tokenizer: Any
    vocab_map: VocabMap
    tokenize: Callable[..., Any]
    """:func:`blocks.tokenize_to_blocks`'s replacement for :func:`blocks.build_splits`."""

    def save(self, output_dir: str | Path) -> Path:
        """The map, saved with the run (``<output_dir>/vocab_map.json``) once the run has claimed its folder."""
        return self.vocab_map.save(Path(output_dir) / "vocab_map.json")


def _texts(data: blocks.DataConfig):
    dataset = blocks.load_text(data.train)
    return (row[data.text_field] for row in dataset)


def load_or_train(name: str, data: blocks.DataConfig, cache_dir: str | Path) -> Any:
    """A tokenizer by path or hub name, or ``bpe:<size>``: trained on ``data.train`` once, then read from the cache."""
    if not name.startswith(TRAINED_PREFIX):
        try:
            return AutoTokenizer.from_pretrained(name)
        except OSError as err:
            raise ConfigError(f"student_tokenizer: cannot load {name!r} ({err}); give a tokenizer directory, a hub "
                              f"name, or '{TRAINED_PREFIX}<size>' to train a byte-level BPE on data.train") from err
    size_text = name[len(TRAINED_PREFIX):]  # checked by config_problems
    files = [data.train] if isinstance(data.train, str) else list(data.train)
    key = hashlib.sha256(repr((files, data.text_field, size_text)).encode()).hexdigest()[:12]
    path = Path(cache_dir) / "tokenizers" / f"bpe-{size_text}-{key}"

    def train() -> None:
        if not (path / "tokenizer.json").exists():
            train_tokenizer(_texts(data), int(size_text)).save_pretrained(path)

    if distributed.is_main():
        train()
    distributed.barrier()
    return AutoTokenizer.from_pretrained(path)


COVERAGE_TEXTS = 64  # training texts a student tokenizer is tried on before anything is tokenised
MOST_COMMON_SHARE = 0.5
"""A tokenizer whose single most common id stands for more of the text's tokens than this does not carry the text
(prose's most common token, a space or 'the', is far below: about a fifth in a character tokenizer): a student
trained on its ids learns to repeat one id, and its perplexity over them reads low while it predicts nothing."""


def coverage_problem(tokenizer: Any, texts: Any) -> str | None:
    """Why ``tokenizer``'s ids do not carry ``texts`` (most of them the unknown token, or any one id), or None."""
    counts: dict[int, int] = {}
    for text in texts:
        for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
            counts[token] = counts.get(token, 0) + 1
    total = sum(counts.values())
    if not total:
        return None
    token, count = max(counts.items(), key=lambda item: item[1])
    if count / total <= MOST_COMMON_SHARE:
        return None
    name = tokenizer.convert_ids_to_tokens(token)
    unknown = " (its unknown token)" if token == tokenizer.unk_token_id else ""
    return (f"{100 * count / total:.0f}% of the training text's tokens are the one id {token} {name!r}{unknown}: "
            "this tokenizer does not carry the text, and every figure over its tokens would be meaningless. Give a "
            f"tokenizer made for this text, or '{TRAINED_PREFIX}<size>' to train one on data.train")


def losses_that_compare_ids(loss: Any) -> list[str]:
    """The loss names in a student's ``loss`` entry that read the teacher by token id (wrong across tokenizers)."""
    if isinstance(loss, Sequence) and not isinstance(loss, str):
        return [name for entry in loss for name in losses_that_compare_ids(entry)]
    name = loss if isinstance(loss, str) else loss.get("name") if isinstance(loss, Mapping) else None
    if name is None:
        return []
    cls = resolve(name)
    return [] if getattr(cls, "cross_tokenizer", False) or not cls.needs_teacher else [name]


def config_problems(config: RunConfig) -> list[str]:
    """What is wrong with a cross-tokenizer run's settings, found before any work (``validate.CHECKS``)."""
    if config.student_tokenizer is None:
        return []
    problems = []
    name = config.student_tokenizer
    if name.startswith(TRAINED_PREFIX):
        size = name[len(TRAINED_PREFIX):]
        if not size.isdigit() or int(size) < 257:
            problems.append(f"student_tokenizer: {name!r} needs a vocabulary size above 256 (the byte symbols and "
                            f"EOS), e.g. '{TRAINED_PREFIX}512'")
    for student in config.students:
        try:
            wrong = losses_that_compare_ids(student.loss)
        except (ValueError, TypeError) as err:
            problems.append(f"students[{student.name}].loss: {err}")
            continue
        if wrong:
            problems.append(
                f"students[{student.name}].loss: {', '.join(wrong)} compares the two models token id by token id, but "
                "with student_tokenizer set their ids stand for different text. Use cross_tokenizer, e.g. "
                "[{name: cross_entropy, weight: 0.5}, {name: cross_tokenizer, weight: 0.5}]."
            )
    return problems


def prepare(config: RunConfig, data: blocks.DataConfig, teacher_tokenizer: Any) -> StudentTokenizer | None:
    """None for a run in one tokenizer; else the students' tokenizer, the map and the paired blocks. Writes only
    the trained tokenizer (``bpe:<size>``) into the cache; the map is saved once the run owns its folder."""
    if config.student_tokenizer is None:
        return None
    problems = config_problems(config)
    if problems:
        raise ConfigError(problems[0])
    tokenizer = load_or_train(config.student_tokenizer, data, config.cache_dir)
    problem = coverage_problem(tokenizer, itertools.islice(_texts(data), COVERAGE_TEXTS))
    if problem is not None:
        raise ConfigError(f"student_tokenizer {config.student_tokenizer!r}: {problem}")
    tokenize = functools.partial(tokenize_to_paired_blocks, teacher_tokenizer=teacher_tokenizer,
                                 teacher_block_size=config.teacher_block_size)
    return StudentTokenizer(tokenizer, VocabMap.build(tokenizer, teacher_tokenizer), tokenize)
