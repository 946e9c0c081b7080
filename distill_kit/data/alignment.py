"""Which teacher tokens cover the same text as each student token, when the two tokenizers differ.

Both tokenizers read the same text; each token gets the byte range of the text it covers, from the fast
tokenizer's character offsets turned into UTF-8 byte offsets. A *span* is a smallest group of consecutive
tokens of both sides that covers identical text: it ends where both sides have a token boundary at the
same byte. Inside a span the two sides can relate in three ways, and a student position ``r`` (which
predicts student token ``r + 1``) is told which one holds for the span of the token it predicts:

* :data:`ONE_TO_ONE`: one student token, one teacher token, the same text. The teacher's next-token
  distribution at the row before that token predicts exactly what the student's does.
* :data:`MERGE`: one student token covering several teacher tokens (the student merges). By the chain rule
  the teacher's probability of the student's token is the product of its probabilities of the span's tokens.
* :data:`SPLIT`: several student tokens in the span (the student splits, or both do, differently). The
  teacher assigns no probability to the student's pieces; only the shape of its distribution is comparable.

For every counted position, ``teacher_row`` is the teacher position whose prediction is compared: the last
teacher token that ends at or before the start of the student's predicted token, so the teacher never reads
text the student has not read. A multi-byte character that a byte-level tokenizer splits into several
tokens gets exact byte ranges for its pieces; where a tokenizer's pieces cannot be measured, they keep the
character's range, end at the same offset and so always fall in one span;
the end of a document is the tokenizer's EOS on both sides, one virtual byte wide, so documents align too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

NONE, ONE_TO_ONE, MERGE, SPLIT = 0, 1, 2, 3
"""``align_kind`` values: not compared (first span of a block, padding), and the three kinds above."""
EOS_WIDTH = 1
"""Bytes of text an end-of-document token stands for: it aligns the two sides, and bits per byte count it once."""


@dataclass(frozen=True)
class Encoding:
    """Token ids with the byte range ``[start, end)`` of text each covers, in one coordinate for both sides."""

    ids: list[int]
    starts: list[int]
    ends: list[int]

    def __len__(self) -> int:
        return len(self.ids)

    def window(self, begin: int, stop: int) -> Encoding:
        return Encoding(self.ids[begin:stop], self.starts[begin:stop], self.ends[begin:stop])

    def byte_counts(self) -> list[int]:
        """Bytes of new text each token adds; pieces of one character sharing its range add none after the first."""
        if not self.ids:
            return []
        starts, ends = np.asarray(self.starts, dtype=np.int64), np.asarray(self.ends, dtype=np.int64)
        covered = np.maximum.accumulate(np.concatenate([[starts[0]], ends[:-1]]))
        return np.maximum(ends - np.maximum(starts, covered), 0).tolist()


def _byte_prefix(text: str) -> np.ndarray:
    """``prefix[i]`` = UTF-8 bytes of ``text[:i]``, from each code point's UTF-8 width."""
    if text.isascii():
        return np.arange(len(text) + 1)
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths)])


def _tokenize(tokenizer: Any, texts: list[str]) -> Any:
    try:
        return tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:  # slow (Python) tokenizers have no offsets
        raise ValueError(f"tokenizer {_name(tokenizer)!r} gives no offsets; cross-tokenizer distillation needs a "
                         "fast tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True))") from err


def encode(tokenizer: Any, text: str, base: int = 0) -> Encoding:
    """``text`` tokenised without special tokens, with byte ranges shifted by ``base``."""
    encoded = _tokenize(tokenizer, [text])
    return _with_bytes(tokenizer, text, encoded["input_ids"][0], encoded["offset_mapping"][0], base)


def _with_bytes(tokenizer: Any, text: str, ids: list[int], offsets: Sequence[tuple[int, int]], base: int) -> Encoding:
    """Character offsets -> byte ranges, checked to tile the text.

    Each token must start where the previous ended, repeat its range (pieces of one character) or be empty.
    Offsets that skip or overlap text (a post-processor that trims them) would make spans of different text
    look equal, so they are refused.
    """
    prefix = _byte_prefix(text)
    chars = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = prefix[chars[:, 0]], prefix[chars[:, 1]]
    previous_start = np.concatenate([[-1], starts[:-1]])
    previous_end = np.concatenate([[0], ends[:-1]])
    repeated = (starts == previous_start) & (ends == previous_end) & (starts < ends)
    bad = np.flatnonzero(~((starts == previous_end) | repeated))
    if bad.size:
        raise ValueError(
            f"tokenizer {_name(tokenizer)!r} gives offsets that skip or overlap text near byte {starts[bad[0]]} of "
            f"{text[:40]!r}...: cross-tokenizer alignment needs offsets that cover the text exactly. Use a fast "
            "tokenizer whose post-processor keeps offsets untrimmed (ByteLevel trim_offsets=False)."
        )
    covered = int(ends[-1]) if len(ends) else 0
    if covered != prefix[-1]:
        raise ValueError(f"tokenizer {_name(tokenizer)!r} covers {covered} of the {prefix[-1]} bytes of "
                         f"{text[:40]!r}...: cross-tokenizer alignment needs every byte covered")
    starts, ends = (starts + base).tolist(), (ends + base).tolist()
    if repeated.any():
        _split_characters(tokenizer, ids, starts, ends)
    return Encoding(list(ids), starts, ends)


def _split_characters(tokenizer: Any, ids: Sequence[int], starts: list[int], ends: list[int]) -> None:
    """Give the byte-level pieces of one character their own bytes, in place.

    Character offsets cannot say where inside a multi-byte character a piece ends, so every piece reports the
    whole character. A byte-level BPE's piece stands for one byte per symbol of its token string, so when the
    pieces' lengths add up to the character's bytes, each gets its exact range: two byte-level tokenizers that
    split a character alike then align piece by piece. Otherwise the pieces keep the shared range (one span).
    """
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and (starts[j + 1], ends[j + 1]) == (starts[i], ends[i]) and starts[i] < ends[i]:
            j += 1
        if j > i:
            if _is_byte_level(tokenizer):
                lengths = [len(token) for token in tokenizer.convert_ids_to_tokens(list(ids[i:j + 1]))]
                if sum(lengths) == ends[i] - starts[i]:
                    position = starts[i]
                    for k, length in zip(range(i, j + 1), lengths, strict=True):
                        starts[k], ends[k] = position, position + length
                        position += length
        i = j + 1


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> Encoding:
    """Documents one after another, each followed by the tokenizer's EOS (``EOS_WIDTH`` virtual bytes wide)."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {_name(tokenizer)!r} has no EOS token; packing needs one to separate documents")
    encoded = _tokenize(tokenizer, list(texts))  # one call: the fast tokenizer spreads it over threads
    ids: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    base = 0
    for text, text_ids, offsets in zip(texts, encoded["input_ids"], encoded["offset_mapping"], strict=True):
        part = _with_bytes(tokenizer, text, text_ids, offsets, base)
        base = part.ends[-1] if part.ids else base
        ids += part.ids + [tokenizer.eos_token_id]
        starts += part.starts + [base]
        ends += part.ends + [base + EOS_WIDTH]
        base += EOS_WIDTH
    return Encoding(ids, starts, ends)


def spans(student_ends: Sequence[int], teacher_ends: Sequence[int]) -> Iterator[tuple[int, int, int, int, bool]]:
    """``(s0, s1, t0, t1, matched)``: student tokens ``[s0, s1)`` and teacher tokens ``[t0, t1)`` cover the same text.

    A span closes where both sides end a token at the same byte; tokens after it that end there too (pieces of a
    split character, empty tokens) join it. The last span is ``matched=False`` when the two sides end at
    different bytes (a block cut that could not fall on a shared boundary): its texts differ.
    """
    s_cut, t_cut = shared_boundaries(student_ends, teacher_ends)
    s0 = t0 = 0
    for s1, t1 in zip(s_cut.tolist(), t_cut.tolist(), strict=True):
        yield s0, s1, t0, t1, True
        s0, t0 = s1, t1
    if s0 < len(student_ends) or t0 < len(teacher_ends):
        yield s0, len(student_ends), t0, len(teacher_ends), False


def shared_boundaries(student_ends: Sequence[int], teacher_ends: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Token counts ``(s, t)`` of both sides at every byte where both end a token, in increasing order."""
    student_ends, teacher_ends = np.asarray(student_ends, dtype=np.int64), np.asarray(teacher_ends, dtype=np.int64)
    shared = np.intersect1d(student_ends, teacher_ends)
    return (np.searchsorted(student_ends, shared, side="right"), np.searchsorted(teacher_ends, shared, side="right"))


@dataclass(frozen=True)
class Alignment:
    """Per student position ``r`` (the prediction of student token ``r + 1``): what it is compared with.

    ``kind`` is one of :data:`NONE`, :data:`ONE_TO_ONE`, :data:`MERGE`, :data:`SPLIT`; ``teacher_row`` the teacher
    position compared (0 where ``kind`` is NONE); ``teacher_last`` the last teacher position of a MERGE span
    (teacher rows ``teacher_row .. teacher_last`` predict the span's teacher tokens), else ``teacher_row``.
    """

    kind: list[int]
    teacher_row: list[int]
    teacher_last: list[int]


def align(student: Encoding, teacher: Encoding) -> Alignment:
    """The alignment of two encodings of the same text (see the module docstring)."""
    n = len(student)
    kind, row, last = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    s1, t1 = shared_boundaries(student.ends, teacher.ends)
    s0, t0 = np.concatenate([[0], s1[:-1]]), np.concatenate([[0], t1[:-1]])
    counted = (s0 > 0) & (t0 > 0)  # the first span of a block has no row before it on either side
    one = counted & (s1 - s0 == 1)
    position = s0[one] - 1
    kind[position] = np.where(t1[one] - t0[one] == 1, ONE_TO_ONE, MERGE)
    row[position], last[position] = t0[one] - 1, t1[one] - 2
    many = counted & (s1 - s0 > 1)
    if many.any():  # every student token of the span, against the teacher row that has read no further
        lengths = (s1 - s0)[many]
        tokens = np.repeat(s0[many], lengths) + np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths,
                                                                                   lengths)
        starts = np.asarray(student.starts, dtype=np.int64)[tokens]
        kind[tokens - 1] = SPLIT
        row[tokens - 1] = last[tokens - 1] = np.searchsorted(np.asarray(teacher.ends), starts, side="right") - 1
    return Alignment(kind.tolist(), row.tolist(), last.tolist())


# ---- the vocabulary map: student tokens whose text is a teacher token -------------------------------------

@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte -> the byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(visible), 0
    for byte in range(256):
        if byte not in visible:
            visible.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer decodes with GPT-2's byte-level alphabet (alone or in a sequence of decoders)."""
    return "ByteLevel" in repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))


def token_texts(tokenizer: Any) -> dict[int, Any]:
    """Each token id -> a key for the text it stands for, equal across tokenizers exactly when the texts are.

    Byte-level BPEs: the token's bytes. SentencePiece-style pieces: ``▁`` is a space, ``<0xNN>`` one byte.
    Otherwise the tokenizer's own ``convert_tokens_to_string``. Special and added tokens are keyed by their
    content, apart from text, so ``<|endoftext|>`` maps to ``<|endoftext|>`` only.
    """
    specials = set(getattr(tokenizer, "all_special_tokens", [])) | set(tokenizer.get_added_vocab())
    byte_level = _is_byte_level(tokenizer)
    decoder = _byte_decoder()
    keys: dict[int, Any] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token in specials:
            keys[token_id] = ("special", token)
        elif byte_level and all(char in decoder for char in token):
            keys[token_id] = bytes(decoder[char] for char in token)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            keys[token_id] = bytes([int(token[3:5], 16)])
        elif "▁" in token:
            keys[token_id] = token.replace("▁", " ").encode("utf-8")
        else:
            keys[token_id] = tokenizer.convert_tokens_to_string([token]).encode("utf-8")
    return keys


@dataclass(frozen=True)
class VocabMap:
    """Pairs ``(student id, teacher id)`` of tokens that stand for the same text; each id appears at most once.

    Built once from the two tokenizers (:meth:`build`), saved with the run as JSON (:meth:`save`) and read back
    with :meth:`load`, which reads numbers only: nothing in it can execute.
    """

    student_ids: tuple[int, ...]
    teacher_ids: tuple[int, ...]
    student_tokenizer: str = ""
    teacher_tokenizer: str = ""

    FORMAT = 1

    def __post_init__(self) -> None:
        if len(self.student_ids) != len(self.teacher_ids):
            raise ValueError("a vocabulary map needs as many student ids as teacher ids")
        for side, ids in (("student", self.student_ids), ("teacher", self.teacher_ids)):
            if len(set(ids)) != len(ids):
                raise ValueError(f"a vocabulary map lists a {side} id twice; each token maps to at most one")

    def __len__(self) -> int:
        return len(self.student_ids)

    @classmethod
    def build(cls, student_tokenizer: Any, teacher_tokenizer: Any) -> VocabMap:
        teacher_by_text: dict[Any, int] = {}
        for token_id, key in sorted(token_texts(teacher_tokenizer).items()):
            teacher_by_text.setdefault(key, token_id)
        pairs: dict[int, int] = {}
        used: set[int] = set()
        for token_id, key in sorted(token_texts(student_tokenizer).items()):
            teacher_id = teacher_by_text.get(key)
            if teacher_id is not None and teacher_id not in used:
                pairs[token_id] = teacher_id
                used.add(teacher_id)
        return cls(tuple(pairs), tuple(pairs.values()), _name(student_tokenizer), _name(teacher_tokenizer))

    def tensors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(student_ids, teacher_ids)`` as int64 tensors, matched pair by pair."""
        return (torch.tensor(self.student_ids, dtype=torch.long, device=device),
                torch.tensor(self.teacher_ids, dtype=torch.long, device=device))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": self.FORMAT, "student_tokenizer": self.student_tokenizer,
                                    "teacher_tokenizer": self.teacher_tokenizer,
                                    "pairs": [list(pair) for pair in zip(self.student_ids, self.teacher_ids,
                                                                         strict=True)]}))
        return path

    @classmethod
    def load(cls, path: str | Path) -> VocabMap:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT or not isinstance(data.get("pairs"), list):
            raise ValueError(f"{str(path)!r} is not a vocabulary map of format {cls.FORMAT}; rebuild it with "
                             "VocabMap.build(student_tokenizer, teacher_tokenizer).save(path)")
        pairs = data["pairs"]
        if not all(isinstance(p, list) and len(p) == 2 and all(type(i) is int and i >= 0 for i in p) for p in pairs):
            raise ValueError(f"{str(path)!r}: every pair must be two token ids (non-negative integers)")
        return cls(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs),
                   str(data.get("student_tokenizer", "")), str(data.get("teacher_tokenizer", "")))


def _name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
