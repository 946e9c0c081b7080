"""Blocks for a teacher and a student with different tokenizers: the same text, two token sequences, one alignment.

How blocks are built: the documents of one ``map`` batch are tokenised by both tokenizers (each document
followed by its EOS) and packed, as :func:`distill_kit.data.blocks.tokenize_to_blocks` packs one side. The
stream is then cut where *both* sides have a token boundary at the same byte, so a block holds the same text
for student and teacher: the largest such cut that leaves at most ``block_size`` student tokens and
``teacher_block_size`` teacher tokens. A block is therefore usually a little shorter than ``block_size``
(padded: attention 0, labels -100), and no token is dropped. Only a single span longer than a whole block
(never seen with real tokenizers) forces a cut inside it; the next block then starts on different bytes on
the two sides, which costs nothing: the first span of every block is never compared.

Columns: the student's ``input_ids``, ``attention_mask``, ``labels`` and ``token_bytes`` (bytes of text per
token, for bits per byte); the same four prefixed ``teacher_``; and the alignment per student position
(``align_kind``, ``align_teacher_row``, ``align_teacher_last``, see :mod:`distill_kit.data.alignment`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from typing import Any

import datasets
import numpy as np

from distill_kit.data.alignment import Encoding, align, encode_documents, shared_boundaries
from distill_kit.data.blocks import IGNORE_INDEX, MAP_BATCH_SIZE, DataError

STUDENT_COLUMNS = ("input_ids", "attention_mask", "labels", "token_bytes")
TEACHER_COLUMNS = tuple(f"teacher_{name}" for name in STUDENT_COLUMNS)
ALIGN_COLUMNS = ("align_kind", "align_teacher_row", "align_teacher_last")
PAIRED_COLUMNS = STUDENT_COLUMNS + TEACHER_COLUMNS + ALIGN_COLUMNS


def cut_points(student: Encoding, teacher: Encoding, block_size: int, teacher_block_size: int) -> Iterator[tuple]:
    """``((s0, s1), (t0, t1))`` token ranges of successive blocks, cut at shared boundaries where they fit."""
    s_cut, t_cut = shared_boundaries(student.ends, teacher.ends)
    s0 = t0 = 0
    while s0 < len(student) or t0 < len(teacher):
        # the furthest shared boundary within both budgets (both counts increase along the boundaries)
        k = min(np.searchsorted(s_cut, s0 + block_size, side="right"),
                np.searchsorted(t_cut, t0 + teacher_block_size, side="right")) - 1
        if k >= 0 and s_cut[k] > s0 and t_cut[k] > t0:
            s1, t1 = int(s_cut[k]), int(t_cut[k])
        else:  # one span larger than a block: cut inside it (see the module docstring)
            s1 = min(s0 + block_size, len(student))
            t1 = bisect.bisect_right(teacher.ends, student.ends[s1 - 1]) if s1 > s0 else len(teacher)
            t1 = max(min(t1, t0 + teacher_block_size), min(t0 + 1, len(teacher)))
        yield (s0, s1), (t0, t1)
        s0, t0 = s1, t1


def _padded(encoding: Encoding, size: int, pad_id: int) -> dict[str, list[int]]:
    n, pad = len(encoding), size - len(encoding)
    return {"input_ids": encoding.ids + [pad_id] * pad, "attention_mask": [1] * n + [0] * pad,
            "labels": encoding.ids + [IGNORE_INDEX] * pad, "token_bytes": encoding.byte_counts() + [0] * pad}


def paired_block(student: Encoding, teacher: Encoding, block_size: int, teacher_block_size: int,
                 student_pad: int, teacher_pad: int) -> dict[str, list[int]]:
    """One block's columns (see the module docstring) from the two encodings of its text."""
    alignment = align(student, teacher)
    pad = block_size - len(student)
    row = _padded(student, block_size, student_pad)
    row |= {f"teacher_{k}": v for k, v in _padded(teacher, teacher_block_size, teacher_pad).items()}
    row |= {"align_kind": alignment.kind + [0] * pad, "align_teacher_row": alignment.teacher_row + [0] * pad,
            "align_teacher_last": alignment.teacher_last + [0] * pad}
    return row


def tokenize_to_paired_blocks(
    dataset: datasets.Dataset | datasets.IterableDataset,
    tokenizer: Any,
    *,
    teacher_tokenizer: Any,
    block_size: int,
    teacher_block_size: int | None = None,
    packing: bool = True,
    text_field: str = "text",
    num_proc: int | None = None,
    desc: str = "tokenising",
    source: str | None = None,
) -> datasets.Dataset | datasets.IterableDataset:
    """Like :func:`~distill_kit.data.blocks.tokenize_to_blocks`, with the teacher's tokens and the alignment.

    ``tokenizer`` is the student's. ``teacher_block_size`` (default ``block_size``) bounds the teacher's tokens
    per block; give the teacher more room when its tokenizer is the finer one, or blocks get short. ``source`` (the
    files) names them in errors.
    """
    teacher_block_size = teacher_block_size or block_size
    pads = [tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            for tok in (tokenizer, teacher_tokenizer)]
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise KeyError(f"data.text_field {text_field!r} is not a column of the dataset; its columns are {columns}")

    def to_blocks(rows: Mapping[str, list[Any]]) -> dict[str, list[list[int]]]:
        bad = next((v for v in rows[text_field] if not isinstance(v, str)), "")
        if not isinstance(bad, str):
            raise DataError(f"{source or 'the data'}: a record has {text_field}={bad!r}, not a string; every "
                            f"record's {text_field!r} must be text")
        groups = [rows[text_field]] if packing else [[text] for text in rows[text_field]]
        out: dict[str, list[list[int]]] = {name: [] for name in PAIRED_COLUMNS}
        for texts in groups:
            student, teacher = encode_documents(tokenizer, texts), encode_documents(teacher_tokenizer, texts)
            for (s0, s1), (t0, t1) in cut_points(student, teacher, block_size, teacher_block_size):
                block = paired_block(student.window(s0, s1), teacher.window(t0, t1), block_size, teacher_block_size,
                                     *pads)
                for name in PAIRED_COLUMNS:
                    out[name].append(block[name])
        return out

    kwargs: dict[str, Any] = {"batched": True, "batch_size": MAP_BATCH_SIZE, "remove_columns": columns}
    if isinstance(dataset, datasets.Dataset):
        kwargs.update(num_proc=num_proc, desc=desc)
    return dataset.map(to_blocks, **kwargs)
