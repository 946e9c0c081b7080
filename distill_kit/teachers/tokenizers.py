"""One tokenizer rule for every model of a run: logit losses compare distributions token id by token id."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distill_kit.engines.models import has_tokenizer as _has_tokenizer


def tokenizer_problems(reference: tuple[str, Any], others: Sequence[tuple[str, Any]]) -> list[str]:
    """Every folder of ``others`` that holds a tokenizer must have ``reference``'s vocabulary (``reference``: a label
    and a folder): logit losses compare the teachers' and the students' distributions token id by token id. Folders
    without a tokenizer are compared by vocabulary size instead (``plan.check_vocabulary``); so is a reference
    without one, which compares nothing here. One rule for the Python path (:func:`check_tokenizers`) and the
    CLI's start-up checks (``run/validate.py``: teachers and student folders), which name the run's tokenizer (or the
    students' own, ``student_tokenizer``) as the reference."""
    from transformers import AutoTokenizer

    def vocabulary(source: Any) -> dict[str, int] | None:
        return AutoTokenizer.from_pretrained(source).get_vocab() if _has_tokenizer(source) else None

    label, source = reference
    others = [(name, other) for name, other in others if _has_tokenizer(other)]
    expected = vocabulary(source) if others else None  # nothing to compare: no tokenizer is read
    if expected is None:
        return []
    problems = []
    for name, other in others:
        theirs = vocabulary(other)
        if theirs != expected:
            problems.append(
                f"{name}: its tokenizer differs from {label}'s ({str(source)!r}: {len(expected)} tokens; "
                f"{str(other)!r}: {len(theirs)}, or other ids). Logit losses compare teachers and students token id "
                "by token id: use teachers and students that share the student's tokenizer (distilling across "
                "tokenizers, loss cross_tokenizer with student_tokenizer, takes one teacher: teacher:)")
    return problems


def fingerprint_problems(cards: Sequence[tuple[str, Any]], reference: Any, label: str = "the run") -> list[str]:
    """Teachers known by their vocabulary's sha256 only (a store, a server: ``TeacherCard.tokenizer_sha256``)
    against the run's tokenizer (a folder, a hub name or a tokenizer): one problem naming each that differs."""
    known = [(name, card) for name, card in cards if card.tokenizer_sha256]
    if not known or reference is None:
        return []
    ours = vocabulary_sha256(reference)
    return [f"{name} ({card.kind} teacher {card.source}): its tokenizer (vocabulary sha256 "
            f"{card.tokenizer_sha256[:12]}) differs from {label}'s ({ours[:12]}). Logit losses compare token ids: "
            "use a teacher with the students' tokenizer" for name, card in known if card.tokenizer_sha256 != ours]


def vocabulary_sha256(tokenizer: Any) -> str:
    """A tokenizer's (or a tokenizer folder's) vocabulary sha256, as stores and servers record theirs."""
    from transformers import AutoTokenizer

    from distill_kit.offline.fingerprints import tokenizer_fingerprint

    return tokenizer_fingerprint(tokenizer if hasattr(tokenizer, "get_vocab") else
                                 AutoTokenizer.from_pretrained(tokenizer))
