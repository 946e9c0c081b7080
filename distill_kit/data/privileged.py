"""Privileged prompts: what a self-teacher (``teachers/self_teacher.py``) sees that its student does not.

Self-distillation with privileged context (SDFT, Shenfeld et al. 2026; SDPO, arXiv 2601.20802) scores the student's
answer twice with one network: the student reads the plain prompt, the teacher a prompt that also carries the
reference answer, a hint, a tool result or a longer system prompt. Only the prompt differs; the answer tokens are
the same in both rows, so the two rows are aligned by the answer.

**The template** (:class:`PrivilegedTemplate`) changes one message of a record's prompt, from the record's fields::

    {role: user, content: "{prompt}\\n\\nA correct answer: {completion}"}                # replace the last user message
    {role: system, content: "Hint: {hint}", replace: false}                          # add a system message first
    {role: user, content: "{content}\\nTool output: {tool_result}", replace: true}    # {content}: the message's own

``content`` is a ``str.format`` string over the record's top-level fields (``{content}`` is the replaced message's
own text). ``replace: true`` (default) replaces the last message of ``role`` in the prompt (a ``system`` message is
added first when there is none); ``replace: false`` adds a message of ``role``: a system message first, any other
right before the answer. *The prompt* is every message before the first counted answer (``data.assistant_turns:
last``: before the last one): a template may change only the prompt, so that the rest of the conversation, the
counted answer above all, renders to the same tokens in both rows. A record it would change after that point, or
that lacks a field the template names, is an error naming the record before any training.

**Where the rows are made.** The data path keeps, per conversation, the privileged *prompt* only (``privileged``
column; batches carry it as ``privileged_input_ids`` ``[B, P]``, right-padded, and ``privileged_lengths`` ``[B]``).
The teacher's row is assembled at the teacher's forward (:func:`teacher_rows`): the privileged prompt followed by
the student row's tokens from its first counted label on. Doing it there, after ``make_batch``, is what lets
on-policy sampling work unchanged: the sampler splices the student's sample after the plain prompt, keeps the batch's
other keys, and the teacher then reads the *sample* after its privileged prompt. The sampler, the loader and the
losses never learn of privileged rows; the teacher returns logits laid out as the student's row
(:func:`to_student_layout`), so every loss of the library reads them as any teacher's.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from distill_kit.errors import ConfigError, DataError

IGNORE_INDEX = -100
ROLES = ("system", "developer", "user", "assistant", "tool")
OWN_CONTENT = "content"
"""The template field that stands for the replaced message's own text."""


@dataclass(frozen=True)
class PrivilegedTemplate:
    """One message of the prompt changed (or added) for the teacher, from the record's fields."""

    content: str
    """``str.format`` string over the record's top-level fields; ``{content}``: the replaced message's own text."""
    role: str = "user"
    """The role of the message changed or added."""
    replace: bool = True
    """True: replace the last ``role`` message of the prompt (system: add one first when there is none). False: add
    a ``role`` message (system: first; any other: right before the answer)."""

    @classmethod
    def parse(cls, value: Any, key: str) -> PrivilegedTemplate:
        """From a run config's value: a mapping ``{content, role, replace}``, or a string (the content of the last
        user message). A ``ConfigError`` naming ``key`` otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = {"content": value}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: give the privileged message as {{role, content, replace}} (or a string, the "
                              f"content of the last user message), got {type(value).__name__}")
        unknown = sorted(set(value) - {"content", "role", "replace"})
        if unknown:
            raise ConfigError(f"{key}: {unknown} are not keys of a privileged message; it takes content, role, replace")
        if not isinstance(value.get("content"), str) or not value["content"]:
            raise ConfigError(f"{key}.content: a non-empty str.format string over the record's fields, e.g. "
                              "'{prompt}\\n\\nA correct answer: {completion}'")
        role, replace = value.get("role", "user"), value.get("replace", True)
        if role not in ROLES or role == "assistant":
            raise ConfigError(f"{key}.role: {role!r}; choose one of {[r for r in ROLES if r != 'assistant']} (the "
                              "answer is the student's, never privileged)")
        if not isinstance(replace, bool):
            raise ConfigError(f"{key}.replace: true or false, got {replace!r}")
        template = cls(value["content"], role, replace)
        template.fields()  # a malformed format string fails here, naming the key
        return template

    def fields(self, key: str = "privileged") -> list[str]:
        """The record fields the content names (``{content}`` excluded), in order."""
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(self.content) if name is not None]
        except ValueError as err:
            raise ConfigError(f"{key}.content: not a valid str.format string ({err}): {self.content!r}") from None
        bad = [name for name in names if not name.isidentifier()]
        if bad:
            raise ConfigError(f"{key}.content: fields {bad} are not plain names; write {{field}} with a record key "
                              "(use {{ and }} for literal braces)")
        return list(dict.fromkeys(name for name in names if name != OWN_CONTENT))

    def messages(self, record: Mapping[str, Any], messages: list[dict[str, str]], prompt_end: int,
                 where: str) -> list[dict[str, str]]:
        """The conversation the teacher reads: ``messages`` with the prompt's (``messages[:prompt_end]``) one message
        changed or added. A ``DataError`` naming ``where`` when the record lacks a field."""
        missing = [name for name in self.fields() if not isinstance(record, Mapping) or name not in record]
        if missing:
            raise DataError(f"{where}: the privileged template names {missing}, and this record has no such field "
                            f"(it has {sorted(record) if isinstance(record, Mapping) else 'none'}): add them to "
                            "every record, or change the template (teachers[...].options.privileged)")
        values = {name: _text(record[name]) for name in self.fields()}
        prompt, rest = list(messages[:prompt_end]), list(messages[prompt_end:])
        at = next((i for i in range(len(prompt) - 1, -1, -1) if prompt[i]["role"] == self.role), None)
        own = prompt[at]["content"] if at is not None and self.replace else ""
        message = {"role": self.role, "content": self.content.format(**values, **{OWN_CONTENT: own})}
        if self.replace and at is not None:
            prompt[at] = message
        elif self.role == "system":
            prompt.insert(0, message)
        elif self.replace:
            raise DataError(f"{where}: the privileged template replaces the last {self.role!r} message of the prompt, "
                            f"and this prompt has none: set replace: false to add one")
        else:
            prompt.append(message)
        return prompt + rest


def _text(value: Any) -> str:
    """A field's text: strings as they are; a list of messages as their contents, one a line; anything else str()."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, Mapping) and "content" in m for m in value):
        return "\n".join(str(m["content"]) for m in value)
    return str(value)


def first_counted(labels: Sequence[int]) -> int | None:
    """Index of the first counted label (None: a prompt, nothing counts)."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)


def privileged_prompt(ids: Sequence[int], labels: Sequence[int], teacher_ids: Sequence[int],
                      teacher_labels: Sequence[int], where: str) -> list[int]:
    """The teacher's prompt tokens (everything before its first counted label, or all of a prompt's), after checking
    that from the first counted label on both renderings are the same tokens with the same labels."""
    start, teacher_start = first_counted(labels), first_counted(teacher_labels)
    if (start is None) != (teacher_start is None):
        raise ConfigError(f"{where}: the privileged conversation counts {'no' if teacher_start is None else 'some'} "
                          "answer tokens where the plain one does not: the template must change the prompt only")
    if start is None:
        return list(teacher_ids)
    if list(ids[start:]) != list(teacher_ids[teacher_start:]) or list(labels[start:]) != list(
            teacher_labels[teacher_start:]):
        raise ConfigError(f"{where}: the privileged template changes the conversation after its first counted answer "
                          "token, and the two rows are aligned by their answers: change only messages before it "
                          "(with several assistant turns, data.assistant_turns: last makes every earlier turn prompt)")
    return list(teacher_ids[:teacher_start])


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """A micro-batch's privileged prompts: ``privileged_input_ids`` ``[B, P]`` right-padded, ``privileged_lengths``."""
    width = max(1, *(len(p) for p in prompts)) if prompts else 1
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, :len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
    return {"privileged_input_ids": ids,
            "privileged_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long)}


PACKING = ("data.packing with a self-teacher (kind: self) is not supported yet: it rebuilds each row with its "
           "privileged prompt and cannot take packed rows apart. Set data.packing: false (and "
           "training.on_policy.pack_to: 0)")
"""The refusal of packed rows under a self-teacher: the plan's, the loader's and the teacher's."""

BATCH_KEYS = ("labels", "privileged_input_ids", "privileged_lengths")
"""What a self-teacher reads of a micro-batch besides the student's ``input_ids`` and ``attention_mask``."""


class TeacherRows(NamedTuple):
    input_ids: torch.Tensor
    """``[B, Lt]``: each row's privileged prompt, then the student row's tokens from its first counted label on."""
    attention_mask: torch.Tensor
    """``[B, Lt]``: 1 on those tokens, 0 on padding."""
    index: torch.Tensor
    """``[B, Ls]``: for each student position, the teacher position that predicts the same next token (the
    student's position plus the row's prompt-length difference, clamped into the teacher row; exact on every
    position that predicts a token of the answer, which are the only ones a loss reads)."""


def teacher_rows(inputs: Mapping[str, torch.Tensor], pad_id: int) -> TeacherRows:
    """The teacher's rows for a micro-batch of student rows (``input_ids``, ``attention_mask``, ``labels``, and the
    privileged prompts of :func:`pad_prompts`); works after on-policy sampling, whose sample is the answer."""
    if "position_ids" in inputs or inputs.get("attention_mask") is None:
        raise ConfigError(PACKING)
    missing = [key for key in BATCH_KEYS if key not in inputs]
    if missing:
        raise ConfigError(f"a self-teacher's micro-batch lacks {missing}: build the chat data with the teacher's "
                          "privileged template (chat.build_splits(..., privileged=...); the CLI does it from the "
                          "self teacher's options.privileged)")
    ids, mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
    prompts, prompt_lengths = inputs["privileged_input_ids"], inputs["privileged_lengths"].to(ids.device)
    counted = labels != IGNORE_INDEX
    lengths = mask.sum(dim=1)
    starts = torch.where(counted.any(dim=1), counted.int().argmax(dim=1), lengths)  # the student's prompt lengths
    shift = prompt_lengths - starts  # the teacher row's tokens are the student's, this much further on
    teacher_lengths = prompt_lengths + lengths - starts
    width = int(teacher_lengths.max())
    at = torch.arange(width, device=ids.device)[None, :]
    from_prompt = at < prompt_lengths[:, None]
    prompt_part = prompts.to(ids.device).gather(1, at.clamp(max=prompts.shape[1] - 1).expand(len(ids), -1))
    answer_part = ids.gather(1, (at - shift[:, None]).clamp(0, ids.shape[1] - 1))
    teacher_mask = at < teacher_lengths[:, None]
    teacher_ids = torch.where(from_prompt, prompt_part, answer_part).masked_fill(~teacher_mask, pad_id)
    index = (torch.arange(ids.shape[1], device=ids.device)[None, :] + shift[:, None]).clamp(0, width - 1)
    return TeacherRows(teacher_ids, teacher_mask.to(mask.dtype), index)


def to_student_layout(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B, Lt, V]`` teacher logits -> ``[B, Ls, V]``: at each student position, the aligned teacher position's."""
    return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
