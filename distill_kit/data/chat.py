"""Chat and prompt/completion records -> token ids rendered by a chat template -> right-padded micro-batches.

**The batch contract** (what the training loop, the losses, evaluation and on-policy sampling rely on). A chat
micro-batch is a dict of three ``torch.long`` tensors of shape ``[B, L]``, ``L`` the longest row of *this*
micro-batch (one conversation a row; with ``data.packing: true`` see "Packed batches" below):

* ``input_ids``: the conversation rendered by the chat template, right-padded with the tokenizer's pad id
  (its EOS id when it has no pad token);
* ``attention_mask``: 1 on the conversation's tokens, 0 on padding;
* ``labels``: equal to ``input_ids`` (not shifted; the loss shifts) where a token counts, -100 elsewhere: on
  system/user/tool messages, on template tokens such as role headers, on padding, and on assistant turns that
  ``data.assistant_turns: last`` leaves out.

The *prompt* of a row is everything before its first counted label (:func:`prompt_lengths`). A row with no
counted label is *prompt-only*: its whole conversation is the prompt and ends with the template's generation
prompt (the assistant header), ready for a model to answer. :func:`left_padded_prompts` gives the prompts
left-padded, as batched generation takes them.

Records (one per JSON object of a ``.jsonl``/``.json``/``.parquet`` file):

* ``{"messages": [{"role": ..., "content": ...}, ...]}``; roles are those of :data:`ROLES`;
* ``{"prompt": ..., "completion": ...}``: a string prompt is one user message and a string completion one
  assistant message; either may also be a list of messages; a missing or null completion makes a prompt.

A record whose last message is not the assistant's is a prompt: it is rendered with the generation prompt and
nothing in it counts. Otherwise every assistant message counts (``data.assistant_turns: all``) or only the last.

**What counts of an assistant message** is what the template writes for it after the assistant header: its
content *and* the end-of-turn token(s) after it (``<|im_end|>\\n`` in ChatML, ``<|eot_id|>`` in Llama 3): the
model must learn to stop. The header itself is the generation prompt and never counts. Two ways find these
tokens, both the template's own rendering through ``tokenizer.apply_chat_template``:

* a template with ``{% generation %}`` markers: ``return_assistant_tokens_mask`` marks every token that overlaps
  a marked span (the shipped templates in ``templates/`` have them);
* any other template: the conversation is rendered up to each assistant message with the generation prompt, and
  up to the end of that message; the tokens between the two are the message's. This needs a template whose
  renderings of a prefix are a prefix of the whole conversation's tokens; one that is not is an error naming the
  record (use a template with markers, e.g. ``data.chat_template: chatml``).

Where both ways work, the first records are rendered both ways and a disagreement is logged.

**Length.** A conversation longer than ``data.block_size`` tokens keeps its first ``block_size`` tokens (the end
of its last answer is cut); if no counted token is left, or if it is a prompt (a prompt must stay whole for
sampling), it is dropped. Both counts are reported (:class:`ChatStats`).

**Batches.** :class:`ChatLoader` groups rows of similar length into the same global batch (less padding),
shuffles the batches, and gives every rank the same number of micro-batches; its order depends only on the seed
and the epoch, and its position is checkpointed like :class:`~distill_kit.data.blocks.BlockLoader`'s.

**Packed batches** (``data.packing: true``, :func:`pack_lengths`, :func:`packed_batch`). Whole conversations
share a row of up to ``block_size`` tokens. A packed micro-batch has ``input_ids``, ``labels`` and
``position_ids`` (``[B, L]``) and **no** ``attention_mask``: positions restart at 0 with every conversation, and
transformers' mask creation (``masking_utils.find_packed_sequence_indices``) then confines attention to each
conversation, which it does only when no 2-D attention mask is given. The label of each conversation's first
token is -100 (``DataCollatorWithFlattening``'s separator), so no token is predicted from the conversation before
it; the loss never counted that label anyway (position ``t`` predicts ``t + 1``), so the counted tokens are those
of the unpacked rows. The end of a shorter row is padding: pad ids, labels -100, positions restarting at 0 (a
segment of its own that no conversation attends to).
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import DataCollatorWithFlattening, PreTrainedTokenizerBase
from transformers.trainer_pt_utils import get_length_grouped_indices

from distill_kit.data import privileged
from distill_kit.data.blocks import (
    IGNORE_INDEX,
    DataConfig,
    EpochLoader,
    _as_list,
    _check_rank,
    load_text,
)
from distill_kit.data.privileged import PrivilegedTemplate
from distill_kit.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
ROLES = ("system", "developer", "user", "assistant", "tool")
ASSISTANT = "assistant"
CHAT_FIELDS = ("messages", "prompt")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Records rendered both ways (markers and prefix diff) to check that they agree: enough to catch a template
# whose markers sit elsewhere than the conversation's own structure says, cheap for any dataset.
CHECKED_RECORDS = 8
# Records tokenised before they are moved into Arrow memory: bounds the Python lists held at once.
CHUNK_RECORDS = 10_000
FEATURES = datasets.Features({
    "input_ids": datasets.Sequence(datasets.Value("int32")),
    "labels": datasets.Sequence(datasets.Value("int32")),
    "length": datasets.Value("int32"),
    "counted": datasets.Value("int32"),
    "record": datasets.Value("string"),
})
ROUTED_FEATURES = datasets.Features({**FEATURES, "teacher": datasets.Value("string")})
"""Conversations of a routed run (``combine: route``): each also names its teacher."""
PRIVILEGED_COLUMN = "privileged"
FIELDS_COLUMN = "fields"
"""With ``keep_fields``: each record's other fields (all but its conversation), as JSON text, for the rewards that ask
for them (``distill_kit/rewards``); batches then carry them as ``records``, one dict a row."""
CONVERSATION_KEYS = ("messages", "prompt", "completion")
"""A self-teacher's prompt of each conversation (``data/privileged.py``): its tokens before the first counted label."""

Batch = dict[str, torch.Tensor]
Message = dict[str, str]


# ---- reading records -------------------------------------------------------------------------------------


def _where(path: str, index: int) -> str:
    return f"{path}: record {index}"


def read_records(files: str | Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for each record of local JSON/JSONL/Parquet files (or a hub dataset's train split).

    ``where`` names the file and the 0-based record index, for errors. Invalid JSON is a :class:`ConfigError`
    naming the file and line.
    """
    for path in _as_list(files):
        suffix = Path(path).suffix.lower()
        if suffix in (".json", ".jsonl") and Path(path).is_file():
            yield from _read_json(path)
        elif suffix == ".parquet" and Path(path).is_file():
            import pyarrow.parquet as pq

            index = 0
            for batch in pq.ParquetFile(path).iter_batches():
                for record in batch.to_pylist():
                    yield _where(path, index), record
                    index += 1
        elif suffix in (".txt", ".text"):
            raise ConfigError(f"{path}: a plain-text file cannot hold chat records; write JSON Lines records with "
                              "'messages' or 'prompt'/'completion' (docs/chat.md), or set data.format: text")
        else:
            try:
                rows = load_text(path)
            except (FileNotFoundError, ValueError) as err:
                raise ConfigError(f"data: {err}") from err
            for index, record in enumerate(rows):
                yield _where(path, index), record


def _read_json(path: str) -> Iterator[tuple[str, Any]]:
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None
        for index, record in enumerate(records):
            yield _where(path, index), record
        return
    index = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: record {index} (line {number}) is not valid JSON ({err})") from None
        yield f"{_where(path, index)} (line {number})", record
        index += 1


def detect_format(config: DataConfig) -> str:
    """``text`` or ``chat``: ``data.format`` unless it is ``auto``; then ``chat`` exactly when the first training
    record is a mapping with a ``messages`` or ``prompt`` field."""
    if config.format != "auto":
        return config.format
    first_file = _as_list(config.train)[0] if _as_list(config.train) else ""
    if Path(first_file).suffix.lower() in (".txt", ".text"):
        return "text"
    try:
        if Path(first_file).is_file():
            record = next((record for _, record in read_records(first_file)), None)
        else:  # a hub dataset: look at its first row without downloading it all
            record = next(iter(load_text(first_file, streaming=True)), None)
    except (ConfigError, FileNotFoundError, ValueError):
        return "text"  # not records at all: the text path reports what is wrong with the data
    return "chat" if isinstance(record, Mapping) and any(key in record for key in CHAT_FIELDS) else "text"


def _messages(value: Any, where: str, name: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: '{name}' must be a non-empty list of {{role, content}} messages, "
                          f"got {value!r:.80}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ConfigError(f"{where}: {name}[{i}] must be a mapping with 'role' and 'content', got {message!r:.80}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ConfigError(f"{where}: {name}[{i}] has unknown role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ConfigError(f"{where}: {name}[{i}] content must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    return messages


def record_messages(record: Any, where: str) -> list[Message]:
    """The conversation of one record (see the module docstring), or a :class:`ConfigError` naming ``where``."""
    if not isinstance(record, Mapping):
        raise ConfigError(f"{where}: a chat record must be a JSON object, got {type(record).__name__}")
    if record.get("messages") is not None:
        messages = _messages(record["messages"], where, "messages")
    elif record.get("prompt") is not None:
        prompt, completion = record["prompt"], record.get("completion")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = _messages(prompt, where, "prompt")
        if isinstance(completion, str):
            messages.append({"role": ASSISTANT, "content": completion})
        elif completion is not None:
            answer = _messages(completion, where, "completion")
            if any(m["role"] != ASSISTANT for m in answer):
                raise ConfigError(f"{where}: every message of 'completion' must have role 'assistant'")
            messages += answer
    else:
        raise ConfigError(f"{where}: a chat record needs 'messages' or 'prompt' (with an optional 'completion'); "
                          f"it has {sorted(record)}")
    if messages[0]["role"] == ASSISTANT:
        raise ConfigError(f"{where}: the conversation starts with an assistant message, so it has no prompt; "
                          "begin it with a system or user message")
    return messages


# ---- templates and masks ---------------------------------------------------------------------------------


def shipped_templates() -> list[str]:
    return sorted(path.stem for path in TEMPLATES_DIR.glob("*.jinja"))


def resolve_template(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
    """The Jinja text to render with: ``data.chat_template`` if set, else the tokenizer's own (its ``default``
    when it has several named ones). ``data.chat_template`` is, in this order, one of the tokenizer's named
    templates, a shipped template (``templates/``), or a Jinja file."""
    own = tokenizer.chat_template
    named = dict(own) if isinstance(own, Mapping) else {}
    if chat_template is None:
        own = named.get("default") if named else own
        if not own:
            raise ConfigError(
                f"the tokenizer ({tokenizer.name_or_path or type(tokenizer).__name__}) has no chat template: set "
                f"data.chat_template to one of the shipped templates ({', '.join(shipped_templates())}) "
                "or a .jinja file")
        return own
    if chat_template in named:
        return named[chat_template]
    if chat_template in shipped_templates():
        return (TEMPLATES_DIR / f"{chat_template}.jinja").read_text(encoding="utf-8")
    path = Path(chat_template)
    if not path.is_file():
        names = f"the tokenizer's ({', '.join(named)}), " if named else ""
        raise ConfigError(f"data.chat_template: {chat_template!r} is neither a named template ({names}shipped: "
                          f"{', '.join(shipped_templates())}) nor an existing .jinja file")
    return path.read_text(encoding="utf-8")


@dataclass
class ChatEncoder:
    """Renders conversations with one template and labels what counts (see the module docstring)."""

    tokenizer: PreTrainedTokenizerBase
    template: str
    assistant_turns: str = "all"

    @property
    def has_markers(self) -> bool:
        return GENERATION_MARKER.search(self.template) is not None

    def _apply(self, messages: list[Message], where: str, **kwargs: Any) -> Mapping[str, Any]:
        """``apply_chat_template``; a template that refuses the conversation is an error naming the record."""
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=True,
                                                      return_dict=True, **kwargs)
        except Exception as err:  # jinja's TemplateError from raise_exception(), and the tokenizer's ValueErrors
            raise ConfigError(f"{where}: the chat template cannot render this conversation: {err}") from err

    def render(self, messages: list[Message], generation_prompt: bool, where: str = "a conversation") -> list[int]:
        return list(self._apply(messages, where, add_generation_prompt=generation_prompt)["input_ids"])

    def marked_spans(self, messages: list[Message], where: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each assistant message's ``[start, end)`` from the template's generation markers."""
        out = self._apply(messages, where, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        spans, start = [], None
        for i, flag in enumerate([*mask, 0]):
            if flag and start is None:
                start = i
            elif not flag and start is not None:
                spans.append((start, i))
                start = None
        return ids, spans

    def prefix_spans(self, messages: list[Message], where: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each assistant message's ``[start, end)`` by rendering the conversation's prefixes."""
        ids = self.render(messages, generation_prompt=False, where=where)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            before = self.render(messages[:i], generation_prompt=True, where=where)
            through = self.render(messages[: i + 1], generation_prompt=False, where=where)
            if through != ids[: len(through)] or before != through[: len(before)]:
                raise ConfigError(
                    f"{where}: the chat template does not render message {i} as a continuation of the messages "
                    "before it, so its tokens cannot be found by rendering prefixes; use a template with "
                    "{% generation %} markers (data.chat_template: " + " or ".join(shipped_templates()) + ")")
            spans.append((len(before), len(through)))
        return ids, spans

    def encode(self, messages: list[Message], where: str, check: bool = False) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one conversation; ``check`` also compares markers with prefix rendering."""
        if messages[-1]["role"] != ASSISTANT:  # a prompt: ends with the generation prompt, counts nothing
            ids = self.render(messages, generation_prompt=True, where=where)
            return ids, [IGNORE_INDEX] * len(ids)
        if self.has_markers:
            ids, spans = self.marked_spans(messages, where)
            if check:
                self._compare(messages, where, ids, spans)
        else:
            ids, spans = self.prefix_spans(messages, where)
        if not spans:
            raise ConfigError(f"{where}: the chat template marks no assistant token in a conversation that ends with "
                              "an assistant message; check its {% generation %} markers")
        if self.assistant_turns == "last":
            spans = spans[-1:]
        labels = [IGNORE_INDEX] * len(ids)
        for start, end in spans:
            labels[start:end] = ids[start:end]
        return ids, labels

    def _compare(self, messages: list[Message], where: str, ids: list[int], spans: list[tuple[int, int]]) -> None:
        try:
            prefix_ids, prefix = self.prefix_spans(messages, where)
        except ConfigError:
            return  # prefixes do not tokenise as the whole does: only the markers can tell
        if (prefix_ids, prefix) != (ids, spans):
            logger.warning("%s: the template's {%% generation %%} markers count tokens %s but rendering prefixes "
                           "gives %s; the markers are used", where, spans, prefix)


# ---- tokenised splits ------------------------------------------------------------------------------------


@dataclass
class ChatStats:
    """What became of a split's records."""

    records: int = 0
    """Records read."""
    prompts: int = 0
    """Kept records with no counted token (prompts)."""
    truncated: int = 0
    """Kept records cut to ``data.block_size`` tokens."""
    dropped: int = 0
    """Records left out: a prompt longer than ``block_size``, or an answer starting beyond it."""
    counted_tokens: int = 0
    """Tokens that count in the loss (labels not -100), over the kept records."""
    first_prompt: str | None = None
    """Where the first prompt record is, for errors."""
    fields: frozenset[str] | None = None
    """With ``keep_fields``: the fields every kept record has beside its conversation."""

    def log(self, name: str, block_size: int) -> None:
        """One line for the run's log; a warning when records were cut or left out."""
        level = logging.WARNING if self.truncated or self.dropped else logging.INFO
        logger.log(level, self.describe(name, block_size))

    def describe(self, name: str, block_size: int) -> str:
        return (f"chat data {name}: {self.records} records, {self.prompts} prompts without an answer, "
                f"{self.truncated} truncated to block_size {block_size}, {self.dropped} dropped (too long to keep "
                f"a prompt or a counted token), {self.counted_tokens} counted tokens")


@dataclass(frozen=True)
class ChatSplits:
    """Tokenised conversations (columns of :data:`FEATURES`) and what became of their records."""

    train: datasets.Dataset
    heldout: datasets.Dataset
    stats: dict[str, ChatStats] = field(default_factory=dict)


def tokenize_records(records: Iterator[tuple[str, Any]], encoder: ChatEncoder, block_size: int,
                     stats: ChatStats, teacher_field: str | None = None,
                     privileged: PrivilegedTemplate | None = None, keep_fields: bool = False) -> datasets.Dataset:
    """Validate, render and truncate every record (every error is raised before any training). ``teacher_field``:
    the key naming each record's teacher (``combine: route``), which every record must then have. ``privileged``:
    a self-teacher's template (``data/privileged.py``): each conversation also keeps the teacher's prompt.
    ``keep_fields``: each conversation also keeps its record's other fields (:data:`FIELDS_COLUMN`)."""
    features = ROUTED_FEATURES if teacher_field else FEATURES
    if privileged is not None:
        features = datasets.Features({**features, PRIVILEGED_COLUMN: datasets.Sequence(datasets.Value("int32"))})
    if keep_fields:
        features = datasets.Features({**features, FIELDS_COLUMN: datasets.Value("string")})
    chunks, rows = [], {name: [] for name in features}

    def flush() -> None:
        if rows["length"]:
            chunks.append(datasets.Dataset.from_dict(rows, features=features))
            for values in rows.values():
                values.clear()

    for where, record in records:
        messages = record_messages(record, where)
        ids, labels = encoder.encode(messages, where, check=stats.records < CHECKED_RECORDS)
        stats.records += 1
        is_prompt = messages[-1]["role"] != ASSISTANT
        if len(ids) > block_size:
            if is_prompt or all(label == IGNORE_INDEX for label in labels[:block_size]):
                stats.dropped += 1
                continue
            ids, labels = ids[:block_size], labels[:block_size]
            stats.truncated += 1
        counted = sum(label != IGNORE_INDEX for label in labels)
        stats.counted_tokens += counted
        if counted == 0:
            stats.prompts += 1
            stats.first_prompt = stats.first_prompt or where
        values = (ids, labels, len(ids), counted, where)
        if teacher_field:
            values += (record_teacher(record, where, teacher_field),)
        if privileged is not None:
            values += (privileged_prompt_of(record, messages, encoder, ids, labels, privileged, where),)
        if keep_fields:
            others = {k: v for k, v in record.items() if k not in CONVERSATION_KEYS} if isinstance(record, Mapping) \
                else {}
            stats.fields = frozenset(others) if stats.fields is None else stats.fields & set(others)
            values += (json.dumps(others),)
        for name, value in zip(features, values, strict=True):
            rows[name].append(value)
        if len(rows["length"]) >= CHUNK_RECORDS:
            flush()
    flush()
    if not chunks:
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    return datasets.concatenate_datasets(chunks)


def privileged_prompt_of(record: Any, messages: list[Message], encoder: ChatEncoder, ids: list[int],
                         labels: list[int], template: PrivilegedTemplate, where: str) -> list[int]:
    """The self-teacher's prompt of one conversation: the record rendered with ``template``'s message, up to its first
    counted label (checked to leave the rest of the conversation as the plain rendering has it)."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == ASSISTANT]
    answered = messages[-1]["role"] == ASSISTANT
    prompt_end = (assistants[-1] if encoder.assistant_turns == "last" else assistants[0]) if answered else len(messages)
    teacher_ids, teacher_labels = encoder.encode(template.messages(record, messages, prompt_end, where), where)
    start, teacher_start, cut = privileged.first_counted(labels), privileged.first_counted(teacher_labels), None
    if start is not None and teacher_start is not None:  # a truncated row keeps its answer's first tokens: those
        cut = teacher_start + len(ids) - start
    return privileged.privileged_prompt(ids, labels, teacher_ids[:cut], teacher_labels[:cut], where)


def record_teacher(record: Any, where: str, field: str) -> str:
    """The teacher a record names (``combine: route``): a non-empty string under ``field``."""
    name = record.get(field) if isinstance(record, Mapping) else None
    if not isinstance(name, str) or not name:
        raise DataError(f"{where}: no {field!r} naming its teacher, and combine: route reads each conversation's "
                        f"teacher from it: add \"{field}\": \"<one of the teachers' names>\" to every record (or set "
                        "data.teacher_field to the key your records use)")
    return name


def build_splits(config: DataConfig, tokenizer: PreTrainedTokenizerBase, route: bool = False,
                 privileged: PrivilegedTemplate | None = None, keep_fields: bool = False) -> ChatSplits:
    """Read, validate, render and hold out chat records as ``config`` says (``data.heldout`` or a fraction);
    ``route``: each record names its teacher (``data.teacher_field``); ``privileged``: a self-teacher's template,
    whose prompt each conversation also keeps (``data/privileged.py``); ``keep_fields``: each conversation keeps
    its record's other fields, for rewards that ask for them (the training split's, ``stats["train"].fields``)."""
    if config.streaming:
        raise ConfigError("data.streaming is for text; chat records are tokenised up front (set it to false)")
    encoder = ChatEncoder(tokenizer, resolve_template(tokenizer, config.chat_template), config.assistant_turns)
    stats = {"train": ChatStats(), "heldout": ChatStats()}
    field = config.teacher_field if route else None
    train = tokenize_records(read_records(config.train), encoder, config.block_size, stats["train"], field, privileged,
                             keep_fields)
    if config.heldout is not None:
        heldout = tokenize_records(read_records(config.heldout), encoder, config.block_size, stats["heldout"], field,
                                   privileged, keep_fields)
    else:
        if len(train) < 2:
            raise ConfigError(f"data.train holds {len(train)} usable chat record(s): too few to hold any out; "
                              "add records or give data.heldout")
        parts = train.train_test_split(test_size=config.heldout_fraction, seed=config.seed)
        train, heldout = parts["train"], parts["test"]
        stats["heldout"] = _stats_of(heldout)
        stats["train"] = _stats_of(train, stats["train"])
    limits = {"train": config.max_train_blocks, "heldout": config.max_heldout_blocks}
    splits = {"train": train, "heldout": heldout}
    for name, limit in limits.items():
        if limit is not None and limit < len(splits[name]):
            splits[name] = splits[name].select(range(limit))
            stats[name] = _stats_of(splits[name], stats[name])
    for name, split in splits.items():
        if len(split) == 0:
            raise ConfigError(f"data.{name}: no chat record is left (read {stats[name].records}, dropped "
                              f"{stats[name].dropped} longer than data.block_size {config.block_size})")
    return ChatSplits(train=splits["train"], heldout=splits["heldout"], stats=stats)


def _stats_of(split: datasets.Dataset, read: ChatStats | None = None) -> ChatStats:
    """Stats of the records a split kept (after holding out or slicing); read/truncated/dropped carry over."""
    counted = split["counted"]
    first = next((where for where, c in zip(split["record"], counted, strict=True) if c == 0), None)
    read = read or ChatStats(records=len(split))
    return ChatStats(records=read.records, prompts=sum(c == 0 for c in counted), truncated=read.truncated,
                     dropped=read.dropped, counted_tokens=sum(counted), first_prompt=first)


def require_answers(splits: ChatSplits, why: str, names: Sequence[str] = ("train", "heldout")) -> None:
    """A :class:`ConfigError` naming a record when a split of ``names`` has no counted token (only prompts).

    ``why`` says what needs reference answers (e.g. the students' losses), for the message.
    """
    for name in names:
        stats = splits.stats.get(name)
        if stats is not None and stats.counted_tokens == 0:
            raise ConfigError(
                f"data.{name} holds only prompts (records without an assistant answer, e.g. {stats.first_prompt}), "
                f"but {why} need reference answers: give records whose last message is the assistant's (or a "
                "'completion')")


# ---- batches ---------------------------------------------------------------------------------------------


def pad_rows(input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], pad_id: int) -> Batch:
    """Right-pad rows of different lengths into the batch contract's three ``[B, L]`` tensors."""
    length = max(len(row) for row in input_ids)
    batch = {"input_ids": torch.full((len(input_ids), length), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(input_ids), length), dtype=torch.long),
             "labels": torch.full((len(input_ids), length), IGNORE_INDEX, dtype=torch.long)}
    for i, (ids, row_labels) in enumerate(zip(input_ids, labels, strict=True)):
        batch["input_ids"][i, : len(ids)] = torch.as_tensor(ids)
        batch["attention_mask"][i, : len(ids)] = 1
        batch["labels"][i, : len(ids)] = torch.as_tensor(row_labels)
    return batch


def prompt_lengths(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[B]``: tokens before each row's first counted label; a prompt-only row's whole (unpadded) length."""
    counted = batch["labels"] != IGNORE_INDEX
    first = counted.int().argmax(dim=1)
    return torch.where(counted.any(dim=1), first, batch["attention_mask"].sum(dim=1))


def left_padded_prompts(batch: Mapping[str, torch.Tensor], pad_id: int) -> Batch:
    """Each row's prompt, left-padded to the longest prompt of the batch: the input of a batched ``generate``.

    Returns ``input_ids`` and ``attention_mask`` of shape ``[B, P]``, ``P`` the longest of :func:`prompt_lengths`,
    on the batch's device; row ``i`` ends with its prompt's last token (the generation prompt).
    """
    lengths = prompt_lengths(batch)
    width = int(lengths.max())
    source = torch.arange(width, device=lengths.device)[None, :] - (width - lengths)[:, None]
    mask = source >= 0
    ids = batch["input_ids"].gather(1, source.clamp(min=0)).masked_fill(~mask, pad_id)
    return {"input_ids": ids, "attention_mask": mask.long()}


# ---- packing ---------------------------------------------------------------------------------------------


def pack_lengths(lengths: Sequence[int], capacity: int, seed: int = 0) -> list[list[int]]:
    """Indices of ``lengths`` grouped into rows of at most ``capacity`` tokens (best-fit decreasing).

    Longest first, each conversation goes into the open row it fills most tightly (least room left that still
    holds it), else it opens a row. Equal lengths are taken in a random order fixed by ``seed``, so the result
    depends only on the lengths and the seed. Written here by hand (transformers has no bin packing; TRL's
    ``pack_dataset`` is not a dependency): open rows are kept by the room they have left, so a conversation finds
    its row by bisection over at most ``capacity`` distinct room values.
    """
    too_long = next((i for i, n in enumerate(lengths) if n > capacity), None)
    if too_long is not None:
        raise ValueError(f"conversation {too_long} has {lengths[too_long]} tokens, more than a packed row's "
                         f"{capacity} (data.block_size): the data was tokenised with another block_size")
    permutation = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    order = sorted(permutation, key=lambda i: -lengths[i])  # stable: ties stay in the seeded order
    rows: list[list[int]] = []
    rooms: list[int] = []  # the distinct amounts of room that open rows have, sorted
    by_room: dict[int, list[int]] = {}  # room -> the open rows with exactly that much
    for i in order:
        need = lengths[i]
        at = bisect.bisect_left(rooms, need)
        if at == len(rooms):
            row, room = len(rows), capacity
            rows.append([])
        else:
            room = rooms[at]
            row = by_room[room].pop()
            if not by_room[room]:
                del by_room[room], rooms[at]
        rows[row].append(i)
        room -= need
        if room:
            if room not in by_room:
                bisect.insort(rooms, room)
                by_room[room] = []
            by_room[room].append(row)
    return rows


def packed_batch(rows: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], pad_id: int,
                 length: int | None = None) -> Batch:
    """``[B, L]`` ``input_ids``, ``labels`` and ``position_ids`` of rows of whole conversations (module docstring).

    Each row is ``(input_ids, labels)`` of its conversations, flattened by transformers'
    ``DataCollatorWithFlattening`` (positions restarting at 0, each conversation's first label -100); rows are
    then right-padded to the longest (or to ``length``), the padding being a segment of its own (positions from 0,
    labels -100). An empty row is all padding (evaluation's filler rows, which count nothing).
    """
    flatten = DataCollatorWithFlattening(return_tensors="pt")
    empty = {name: torch.zeros((1, 0), dtype=torch.long) for name in ("input_ids", "labels", "position_ids")}
    flat = [flatten([{"input_ids": list(ids), "labels": list(labels)} for ids, labels in row]) if row else empty
            for row in rows]
    length = max(1, length or 0, *(part["input_ids"].shape[1] for part in flat))
    batch = {"input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
             "labels": torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long),
             "position_ids": torch.zeros((len(rows), length), dtype=torch.long)}
    for i, part in enumerate(flat):
        n = part["input_ids"].shape[1]
        for name in batch:
            batch[name][i, :n] = part[name][0]
        batch["position_ids"][i, n:] = torch.arange(length - n)
    return batch


def pack_padded(batch: Mapping[str, torch.Tensor], capacity: int, pad_id: int,
                agree: Callable[[tuple[int, int]], Sequence[int]] | None = None) -> Batch:
    """A right-padded micro-batch (one conversation a row: ``input_ids``, ``labels``, ``attention_mask``) as packed
    rows of up to ``capacity`` tokens (:func:`pack_lengths`, :func:`packed_batch`), on the batch's device: the same
    conversations, tokens and counted labels; a row longer than ``capacity`` gets a row of its own. ``agree`` maps
    the packing's (rows, tokens of the fullest row) to the shape to pad to, at least as large (every rank's agreed
    shape: the extra rows and positions count nothing). On-policy steps pack their sampled micro-batches so
    (``OnPolicyConfig.pack_to``)."""
    lengths, rows = _pack_plan(batch, capacity)
    ids, labels = batch["input_ids"].cpu(), batch["labels"].cpu()
    conversations = [(ids[i, :n].tolist(), labels[i, :n].tolist()) for i, n in enumerate(lengths)]
    shape = (len(rows), max(sum(lengths[i] for i in row) for row in rows))
    count, length = agree(shape) if agree is not None else shape
    members = [[conversations[i] for i in row] for row in rows] + [[]] * (count - len(rows))
    packed = packed_batch(members, pad_id, length=length)
    return {name: value.to(batch["input_ids"].device) for name, value in packed.items()}


def _pack_plan(batch: Mapping[str, torch.Tensor], capacity: int) -> tuple[list[int], list[list[int]]]:
    extra = sorted(set(batch) - {"input_ids", "labels", "attention_mask"})
    if extra:
        raise ConfigError(f"packing a sampled micro-batch keeps input_ids, labels and attention_mask only, and this "
                          f"one also has {extra} (combine: route's teacher_id?): set training.on_policy.pack_to: 0 "
                          "(data.packing: false)")
    lengths = [int(n) for n in batch["attention_mask"].sum(1).tolist()]
    return lengths, pack_lengths(lengths, max(capacity, *lengths))


def packed_model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What a model's forward must get, besides ``input_ids``, for a packed batch to stay exact; ``{}`` otherwise.

    transformers confines attention to each conversation from ``position_ids`` only with no 2-D attention mask and
    no cache (``masking_utils._preprocess_mask_arguments``); a model in eval mode or under ``no_grad`` otherwise
    builds a cache by default (``use_cache``) and then attends across conversations.
    """
    if "position_ids" not in batch:
        return {}
    return {"position_ids": batch["position_ids"], "attention_mask": None, "use_cache": False}


ROUTED_PACKING = ("data.packing: true with combine: route is not supported yet: a packed row would hold "
                  "conversations of several teachers. Set data.packing: false, or combine: sum")
"""The refusal of packed routed rows: the loader's, and the CLI's start-up check's (``run/validate.py``)."""


class ChatLoader(EpochLoader):
    """Right-padded micro-batches of one rank over tokenised conversations; every rank gets ``len(self)``.

    An epoch's order (:meth:`epoch_order`): the records in a random order fixed by ``seed`` and the epoch, sorted
    by length inside groups of up to 50 global batches of ``world_size * micro_batch_size`` rows, cut into global
    batches, then the whole global batches shuffled. Rank
    ``r`` takes the ``r``-th slice of each global batch, as :class:`~distill_kit.data.blocks.BlockLoader` does.
    With ``drop_last`` (training) a last partial global batch is left out of the epoch (other rows each epoch);
    without it (evaluation) it is filled with one-token rows that count nothing, so every rank still runs it.

    With ``packing`` (``data.packing: true``) a row holds whole conversations, up to ``block_size`` tokens
    (:func:`pack_lengths`, once, fixed by ``seed``), and the loader works on those rows as above: an epoch is the
    rows in a random order fixed by ``seed`` and the epoch, rank ``r`` taking the ``r``-th slice of each global
    batch of rows, so every rank runs ``len(self)`` micro-batches of :func:`packed_batch`.
    """

    def __init__(self, dataset: datasets.Dataset, micro_batch_size: int, *, pad_id: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 packing: bool = False, block_size: int | None = None, route: Sequence[str] | None = None) -> None:
        """``route``: the teachers' names, in order (``combine: route``): each conversation goes to the teacher its
        record names, and every global batch holds one teacher's conversations (:meth:`epoch_order`), so each
        micro-batch carries ``teacher_id`` and every rank forwards the same one teacher at the same step."""
        _check_rank(rank, world_size, micro_batch_size)
        if route is not None and packing:
            raise ConfigError(ROUTED_PACKING)
        if packing and PRIVILEGED_COLUMN in dataset.column_names:
            raise ConfigError(privileged.PACKING)
        global_batch = world_size * micro_batch_size
        if len(dataset) == 0:
            raise ValueError("the dataset has no conversations: check the data files")
        if packing and block_size is None:
            raise ValueError("a packed ChatLoader needs block_size, the tokens a row holds")
        lengths = list(dataset["length"])
        self.packed_rows = pack_lengths(lengths, block_size, seed) if packing else None
        rows = len(self.packed_rows) if packing else len(dataset)
        if drop_last and rows < global_batch:
            what = (f"{len(dataset)} conversations packed into {rows} rows of data.block_size {block_size} tokens"
                    if packing else f"{len(dataset)} conversations")
            raise ConfigError(
                f"the data has {what} but one global batch needs world_size ({world_size}) x micro_batch_size "
                f"({micro_batch_size}) = {global_batch} rows: use more data, a smaller micro-batch or fewer ranks"
                + (", or a smaller data.block_size" if packing else ""))
        super().__init__(dataset, micro_batch_size, rank, world_size, seed, shuffle, drop_last)
        self.lengths, self.pad_id, self.block_size = lengths, pad_id, block_size
        if packing:
            whole, rest = divmod(rows, global_batch)
            self.num_batches = whole + (1 if rest and not drop_last else 0)
        self.teacher_ids = None if route is None else teacher_ids(dataset, route)
        if self.teacher_ids is not None:
            self.num_batches = len(self.epoch_order(0)) // global_batch

    def describe_packing(self, name: str) -> str:
        """One line for the run's log: conversations, rows, and the share of the rows' positions that are tokens."""
        rows = len(self.packed_rows or [])
        return (f"chat data {name}: {len(self.lengths)} conversations packed into {rows} rows of block_size "
                f"{self.block_size}, {sum(self.lengths) / max(rows * (self.block_size or 1), 1):.1%} of their "
                "positions real tokens")

    def epoch_order(self, epoch: int) -> list[int]:
        """Row indices of ``epoch``, global batch after global batch (a partial one last).

        The length grouping is the Hugging Face Trainer's (``get_length_grouped_indices``: a random permutation,
        sorted by length inside "megabatches" of up to 50 batches); its batches are then shuffled, so that
        consecutive steps do not run from long to short. Without ``shuffle`` the order is the same every epoch.
        """
        size = self.world_size * self.micro_batch_size
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + (epoch if self.shuffle else 0))
        if self.teacher_ids is not None:
            return self._routed_order(size, generator)
        if self.packed_rows is not None:  # packed rows: nearly all full already, so no length grouping
            count = len(self.packed_rows)
            return torch.randperm(count, generator=generator).tolist() if self.shuffle else list(range(count))
        order = get_length_grouped_indices(self.lengths, size, generator=generator)
        batches = [order[i : i + size] for i in range(0, len(order), size)]
        whole = [b for b in batches if len(b) == size]
        if self.shuffle:
            whole = [whole[i] for i in torch.randperm(len(whole), generator=generator).tolist()]
        return [i for b in whole + [b for b in batches if len(b) < size] for i in b]

    def _routed_order(self, size: int, generator: torch.Generator) -> list[int]:
        """Each teacher's conversations length-grouped into global batches of their own; the whole batches of every
        teacher shuffled together. A teacher's last partial batch is left out of a training epoch (other rows each
        epoch) and, in evaluation, filled with its own first rows marked ``-1`` - 1 - row (they count nothing)."""
        batches = []
        for teacher in sorted(set(self.teacher_ids)):
            rows = [i for i, t in enumerate(self.teacher_ids) if t == teacher]
            grouped = get_length_grouped_indices([self.lengths[i] for i in rows], size, generator=generator)
            ordered = [rows[i] for i in grouped]
            for start in range(0, len(ordered), size):
                chunk = ordered[start:start + size]
                if len(chunk) < size and self.drop_last:
                    continue
                batches.append(chunk + [-1 - ordered[0]] * (size - len(chunk)))
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        return [i for b in batches for i in b]

    def batch(self, epoch: int, index: int, order: Sequence[int] | None = None) -> Batch:
        """Micro-batch ``index`` of ``epoch`` for this rank (``order``: :meth:`epoch_order`'s, rows if packed)."""
        order = self.epoch_order(epoch) if order is None else order
        start = (index * self.world_size + self.rank) * self.micro_batch_size
        chosen = list(order[start : start + self.micro_batch_size])
        short = self.micro_batch_size - len(chosen)
        if self.packed_rows is not None:
            members = [self.packed_rows[row] for row in chosen]
            rows = self.dataset[[i for row in members for i in row]] if chosen else {"input_ids": [], "labels": []}
            pairs = iter(zip(rows["input_ids"], rows["labels"], strict=True))
            packed = [[next(pairs) for _ in row] for row in members]
            return packed_batch(packed + [[]] * short, self.pad_id)
        if self.teacher_ids is not None:  # filler rows (index -1 - row) are their teacher's rows, counting nothing
            fillers = [i < 0 for i in chosen]
            chosen = [-1 - i if i < 0 else i for i in chosen]
        rows = self.dataset[chosen] if chosen else {"input_ids": [], "labels": []}
        ids = list(rows["input_ids"]) + [[self.pad_id]] * short
        labels = list(rows["labels"]) + [[IGNORE_INDEX]] * short
        extra = {}
        if PRIVILEGED_COLUMN in self.dataset.column_names:  # a self-teacher's prompts (data/privileged.py)
            extra = privileged.pad_prompts(list(rows.get(PRIVILEGED_COLUMN, [])) + [[self.pad_id]] * short,
                                           self.pad_id)
        if FIELDS_COLUMN in self.dataset.column_names:  # each record's other fields, for the rewards
            extra["records"] = [json.loads(text) for text in rows.get(FIELDS_COLUMN, [])] + [{}] * short
        if self.teacher_ids is None:
            return pad_rows(ids, labels, self.pad_id) | extra
        labels = [[IGNORE_INDEX] * len(row) if filler else row for row, filler in zip(labels, fillers, strict=True)]
        return pad_rows(ids, labels, self.pad_id) | extra | {
            "teacher_id": torch.tensor([self.teacher_ids[i] for i in chosen], dtype=torch.long)}


def teacher_ids(dataset: datasets.Dataset, names: Sequence[str]) -> list[int]:
    """Each conversation's teacher as its index in ``names``; a name no teacher has is a ``DataError`` naming the
    record and the teachers there are."""
    if "teacher" not in dataset.column_names:
        raise ConfigError("combine: route sends each conversation to its teacher, and these conversations name none: "
                          "build them with chat.build_splits(..., route=True) from records that name their teacher "
                          "(data.teacher_field)")
    index = {name: i for i, name in enumerate(names)}
    ids = []
    for teacher, where in zip(dataset["teacher"], dataset["record"], strict=True):
        if teacher not in index:
            raise DataError(f"{where}: teacher {teacher!r} is not one of the run's teachers {list(names)}: fix the "
                            "record, or add that teacher to teachers:")
        ids.append(index[teacher])
    return ids


def pad_id_of(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id padding is written with: the pad token's, else EOS's (padding never counts either way)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an EOS token to pad chat batches with")
    return pad
