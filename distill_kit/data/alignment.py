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

import bisect
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

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
        """Bytes of new text each token adds; the pieces of a split character after the first add none."""
        counts, covered = [], self.starts[0] if self.ids else 0
        for start, end in zip(self.starts, self.ends, strict=True):
            counts.append(max(end - max(start, covered), 0))
            covered = max(covered, end)
        return counts


def _byte_prefix(text: str) -> list[int]:
    """``prefix[i]`` = UTF-8 bytes of ``text[:i]``."""
    prefix = [0]
    for char in text:
        prefix.append(prefix[-1] + len(char.encode("utf-8")))
    return prefix


def encode(tokenizer: Any, text: str, base: int = 0) -> Encoding:
    """``text`` tokenised without special tokens, with byte ranges shifted by ``base``.

    The ranges must tile the text: each token starts where the previous ended, repeats its range (pieces of
    one character) or is empty. Offsets that skip or overlap text (a post-processor that trims them, a
    slow tokenizer) would make spans of different text look equal, so they are refused.
    """
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:  # slow (Python) tokenizers have no offsets
        raise ValueError(f"tokenizer {_name(tokenizer)!r} gives no offsets; cross-tokenizer distillation needs a "
                         "fast tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True))") from err
    prefix = _byte_prefix(text)
    starts, ends, covered, previous = [], [], 0, None
    for char_start, char_end in encoded["offset_mapping"]:
        start, end = base + prefix[char_start], base + prefix[char_end]
        if not (start == base + covered or (start, end) == previous or start == end == base + covered):
            raise ValueError(
                f"tokenizer {_name(tokenizer)!r} gives offsets that skip or overlap text near byte {start - base} of "
                f"{text[:40]!r}...: cross-tokenizer alignment needs offsets that cover the text exactly. Use a fast "
                "tokenizer whose post-processor keeps offsets untrimmed (ByteLevel trim_offsets=False)."
            )
        starts.append(start)
        ends.append(end)
        covered, previous = end - base, (start, end)
    _split_characters(tokenizer, encoded["input_ids"], starts, ends)
    if covered != prefix[-1]:
        raise ValueError(f"tokenizer {_name(tokenizer)!r} covers {covered} of the {prefix[-1]} bytes of "
                         f"{text[:40]!r}...: cross-tokenizer alignment needs every byte covered")
    return Encoding(list(encoded["input_ids"]), starts, ends)


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
            if "ByteLevel" in _decoder_types(tokenizer):
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
    ids: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    base = 0
    for text in texts:
        part = encode(tokenizer, text, base)
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
    i = j = s0 = t0 = 0
    n_s, n_t = len(student_ends), len(teacher_ends)
    while i < n_s and j < n_t:
        if student_ends[i] < teacher_ends[j]:
            i += 1
        elif teacher_ends[j] < student_ends[i]:
            j += 1
        else:
            end = student_ends[i]
            while i + 1 < n_s and student_ends[i + 1] == end:
                i += 1
            while j + 1 < n_t and teacher_ends[j + 1] == end:
                j += 1
            i, j = i + 1, j + 1
            yield s0, i, t0, j, True
            s0, t0 = i, j
    if s0 < n_s or t0 < n_t:
        yield s0, n_s, t0, n_t, False


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
    kind, row, last = [NONE] * n, [0] * n, [0] * n
    for s0, s1, t0, t1, matched in spans(student.ends, teacher.ends):
        if not matched or s0 == 0 or t0 == 0:  # the first span of a block has no row before it on either side
            continue
        if s1 - s0 == 1:
            kind[s0 - 1] = ONE_TO_ONE if t1 - t0 == 1 else MERGE
            row[s0 - 1], last[s0 - 1] = t0 - 1, t1 - 2
            continue
        for token in range(s0, s1):
            teacher_row = bisect.bisect_right(teacher.ends, student.starts[token], lo=t0 - 1, hi=t1) - 1
            kind[token - 1], row[token - 1], last[token - 1] = SPLIT, teacher_row, teacher_row
    return Alignment(kind, row, last)


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


def _decoder_types(tokenizer: Any) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    found = {decoder.get("type")}
    found |= {part.get("type") for part in decoder.get("decoders", [])}
    return {name for name in found if name}


def token_texts(tokenizer: Any) -> dict[int, Any]:
    """Each token id -> a key for the text it stands for, equal across tokenizers exactly when the texts are.

    Byte-level BPEs: the token's bytes. SentencePiece-style pieces: ``▁`` is a space, ``<0xNN>`` one byte.
    Otherwise the tokenizer's own ``convert_tokens_to_string``. Special and added tokens are keyed by their
    content, apart from text, so ``<|endoftext|>`` maps to ``<|endoftext|>`` only.
    """
    specials = set(getattr(tokenizer, "all_special_tokens", [])) | set(tokenizer.get_added_vocab())
    byte_level = "ByteLevel" in _decoder_types(tokenizer)
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
