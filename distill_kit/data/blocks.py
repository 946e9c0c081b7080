"""Text files (or a hub dataset) -> tokenised fixed-length blocks -> equal micro-batches on every rank.

Three things here matter for distillation on DeepSpeed and are easy to get wrong:

* **Every rank runs the same number of micro-batches.** A ZeRO-3 teacher gathers its parameters
  with collectives inside every forward; a rank that runs one forward fewer leaves the others
  waiting forever. :class:`BlockLoader` therefore cuts the epoch to a whole number of global batches,
  and, where no block may be dropped (evaluation), fills the last one with blocks that count no
  token (labels all -100) rather than giving some rank fewer batches.
* **No token is lost or reordered by packing.** Documents are joined with the tokenizer's EOS token
  and cut into ``block_size`` blocks; the last short block is padded with ``attention_mask`` 0 and
  ``labels`` -100, never silently dropped.
* **Resumable and deterministic.** The order depends only on ``seed`` and the epoch, and
  :class:`LoaderPosition` (epoch, index) restores the exact next batch after a restart.

Blocks are stored by ``datasets`` in its Arrow cache, which is memory-mapped, so a tokenised corpus
larger than RAM works; ``streaming=True`` avoids even writing that cache (see :class:`StreamingBlockLoader`).
Labels follow the Hugging Face convention: ``labels`` equal ``input_ids`` (not shifted; the loss
shifts), with -100 where nothing is to be predicted.
"""

from __future__ import annotations

import codecs
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from distill_kit.config import check_seed
from distill_kit.errors import DataError

IGNORE_INDEX = -100
BLOCK_COLUMNS = ("input_ids", "attention_mask", "labels")
# File endings -> the ``datasets`` builder that reads them.
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# Documents tokenised per ``map`` call: large enough to amortise the call, small enough for RAM.
MAP_BATCH_SIZE = 1000

# Formats read as UTF-8 text, whose bytes are checked before anything is tokenised.
TEXT_FORMATS = {".txt", ".text", ".json", ".jsonl"}
CHECK_CHUNK = 1 << 24  # bytes decoded at a time when checking a file's encoding

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it becomes blocks."""

    train: str | Sequence[str]
    """Local text/JSON(L)/Parquet file(s), or a hub dataset name when the hub is reachable."""
    heldout: str | Sequence[str] | None = None
    """Held-out file(s); if None, ``heldout_fraction`` of the training documents is held out."""
    heldout_fraction: float = 0.05
    text_field: str = "text"
    """The column holding the text (``text`` for .txt files)."""
    block_size: int = 256
    """Tokens per block; for chat data the longest conversation kept (longer ones are cut, docs/chat.md)."""
    packing: bool | None = None
    """Text: true or null (default) joins documents with EOS and cuts full blocks (attention spans documents, as
    in pretraining); false puts one document per block, padded. Chat: true packs whole conversations into rows of
    up to block_size tokens, positions restarting per conversation so that none attends to or predicts another
    (docs/chat.md#packing); false or null (default) puts one conversation per row, padded."""
    max_train_blocks: int | None = None
    """Keep only the first N training blocks (chat: conversations; a data-scarce slice in the data's order)."""
    max_heldout_blocks: int | None = None
    """Keep only the first N held-out blocks (chat: conversations; bounds evaluation time)."""
    streaming: bool = False
    """Read and tokenise lazily instead of writing the Arrow cache; see :class:`StreamingBlockLoader`. Needs
    ``heldout`` files; the CLI reads the held-out blocks (at most ``max_heldout_blocks``) into memory."""
    seed: int = 0
    num_proc: int | None = None
    """Processes for tokenisation; None tokenises in this process."""
    format: Literal["auto", "text", "chat"] = "auto"
    """text: raw documents, packed into blocks (blocks.py). chat: conversations with 'messages' or
    'prompt'/'completion' fields, rendered with a chat template, only assistant tokens counting (docs/chat.md).
    auto: chat exactly when the first training record has a 'messages' or 'prompt' field."""
    chat_template: str | None = None
    """Chat data: a template used instead of the tokenizer's own (the teacher's, which both models share): one of
    the tokenizer's named templates, a shipped one (chatml, llama3) or a .jinja file; None uses the tokenizer's."""
    assistant_turns: Literal["all", "last"] = "all"
    """Chat data: which assistant messages of a conversation count in the loss; the others are context."""
    teacher_field: str = "teacher"
    """Chat data with ``combine: route``: the record key naming the teacher of each conversation (one of the
    ``teachers:`` names); the run forwards each teacher only over its conversations (docs/teachers.md#routing)."""

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"data.block_size must be at least 2 (a token and its successor), got {self.block_size}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"data.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        for name in ("max_train_blocks", "max_heldout_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"data.{name} must be a positive number of blocks or None, got {value}")
        check_seed(self.seed, "data.seed")


@dataclass(frozen=True)
class DataSplits:
    """Tokenised blocks with the columns of :data:`BLOCK_COLUMNS`."""

    train: datasets.Dataset | datasets.IterableDataset
    heldout: datasets.Dataset | datasets.IterableDataset


def _as_list(files: str | Sequence[str]) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


def _looks_local(paths: Sequence[str]) -> bool:
    return any(Path(path).exists() for path in paths) or {Path(path).suffix.lower() for path in paths} <= set(BUILDERS)


_CHECKED: dict[str, tuple[int, int]] = {}  # files found readable, by path: (size, mtime) then; checked once


def _file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as data, or None: missing, unreadable, empty, or (text) not UTF-8."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_file():
        return f"{path} is not a file"
    stat = path.stat()
    if _CHECKED.get(str(path)) == (stat.st_size, stat.st_mtime_ns):
        return None
    try:
        with path.open("rb") as handle:
            if path.suffix.lower() not in TEXT_FORMATS:
                handle.read(1)
            elif (problem := _utf8_problem(handle)) is not None:
                return f"{path} {problem}"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or err})"
    if stat.st_size == 0:
        return f"{path} is empty"
    _CHECKED[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return None


def _utf8_problem(handle: Any) -> str | None:
    """Where a file stops being UTF-8 (line and byte), or None; also a JSON file of nothing but blank lines."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset, blank = 1, 0, True
    while chunk := handle.read(CHECK_CHUNK):
        try:
            blank = blank and not chunk.strip()
            decoder.decode(chunk)
        except UnicodeDecodeError as err:
            line += chunk.count(b"\n", 0, err.start)
            return (f"is not UTF-8 text: line {line} has the byte 0x{chunk[err.start]:02x} (byte {offset + err.start}"
                    " of the file). Re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8")
        line += chunk.count(b"\n")
        offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "is not UTF-8 text: it ends inside a multi-byte character (a truncated file?)"
    if blank and offset and Path(getattr(handle, "name", "")).suffix.lower() in (".json", ".jsonl"):
        return "holds no records (only blank lines)"
    return None


def check_files(files: str | Sequence[str]) -> list[str]:
    """Every problem of local data files that can be found without tokenising, one line each (none for a hub
    dataset name): missing, unreadable, empty, not UTF-8 (with the line), mixed formats."""
    paths = _as_list(files)
    if not paths:
        return ["no data files given: set data.train to a file, a list of files or a hub dataset name"]
    if not _looks_local(paths):
        return []
    problems = [problem for path in paths if (problem := _file_problem(Path(path))) is not None]
    suffixes = {Path(path).suffix.lower() for path in paths}
    if len(suffixes) != 1 or next(iter(suffixes)) not in BUILDERS:
        problems.append(f"data files must share one format among {sorted(BUILDERS)}; got endings {sorted(suffixes)}")
    return problems


def load_text(
    files: str | Sequence[str], *, streaming: bool = False, text_field: str | None = None
) -> datasets.Dataset | datasets.IterableDataset:
    """Load local files (one format per call) or, if ``files`` names no local path, a hub dataset's train split.

    Local files are checked first (:func:`check_files`); with ``text_field``, a loaded (not streamed) dataset's
    column is checked to hold only strings. Each problem is a :class:`DataError` (or FileNotFoundError for a
    missing file) naming the file.
    """
    paths = _as_list(files)
    if not paths:
        raise ValueError("no data files given: set data.train to a file, a list of files or a hub dataset name")
    suffixes = {Path(path).suffix.lower() for path in paths}
    looks_local = _looks_local(paths)
    if not looks_local:
        try:
            return datasets.load_dataset(paths[0], split="train", streaming=streaming)
        except Exception as error:  # the hub library raises many types; all mean "could not get it"
            raise FileNotFoundError(
                f"{paths[0]!r} is neither a local file nor a dataset the hub returned ({error}). "
                "Give a path to .txt/.json/.jsonl/.parquet files, or a hub name when the hub is reachable."
            ) from error
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"data file(s) not found: {', '.join(missing)}")
    if len(suffixes) != 1 or next(iter(suffixes)) not in BUILDERS:
        raise ValueError(
            f"data files must share one format among {sorted(BUILDERS)}; got endings {sorted(suffixes)}"
        )
    problems = check_files(paths)
    if problems:
        raise DataError("bad data file(s): " + "; ".join(problems))
    builder = BUILDERS[next(iter(suffixes))]
    try:
        dataset = datasets.load_dataset(builder, data_files=paths, split="train", streaming=streaming)
    except Exception as err:  # pyarrow and the builders raise many types; the cause is in the chain
        cause = err.__cause__ or err.__context__ or err
        raise DataError(f"cannot read data file(s) {', '.join(paths)} as {builder}: {type(cause).__name__}: "
                        f"{str(cause).splitlines()[0] if str(cause) else 'no detail'}. Check that each file is "
                        f"valid {builder} ({'one JSON object per line' if builder == 'json' else 'its format'})."
                        ) from err
    if text_field is not None and isinstance(dataset, datasets.Dataset):
        _check_text_column(dataset, text_field, ", ".join(paths))
    return dataset


def _check_text_column(dataset: datasets.Dataset, text_field: str, source: str) -> None:
    """Every record's ``text_field`` is a string: numbers, nulls and nested values are errors naming one."""
    feature = dataset.features.get(text_field)
    if feature is None:
        return  # tokenize_to_blocks names the missing column with the ones there are
    is_text = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    if is_text and dataset.data.column(text_field).null_count == 0:
        return
    index, value = next((i, v) for i, v in enumerate(dataset[text_field]) if not isinstance(v, str))
    raise DataError(f"{source}: record {index} (counting from 0) has {text_field}={value!r}, not a string; "
                    f"every record's {text_field!r} must be text (or set data.text_field to the column that is)")


def _blocks_from_ids(ids: list[int], block_size: int, pad_id: int) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """Cut ``ids`` into blocks; the last short one is padded (mask 0, label -100)."""
    for start in range(0, len(ids), block_size):
        chunk = ids[start : start + block_size]
        pad = block_size - len(chunk)
        yield chunk + [pad_id] * pad, [1] * len(chunk) + [0] * pad, chunk + [IGNORE_INDEX] * pad


def tokenize_to_blocks(
    dataset: datasets.Dataset | datasets.IterableDataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    block_size: int,
    packing: bool = True,
    text_field: str = "text",
    num_proc: int | None = None,
    desc: str = "tokenising",
    source: str | None = None,
) -> datasets.Dataset | datasets.IterableDataset:
    """Tokenise ``text_field`` and turn documents into ``block_size`` blocks (see the module docstring).

    Each document ends with the tokenizer's EOS token, so the model learns where documents end and
    packed neighbours are separated. Packing joins the documents of one ``map`` batch; only the
    last block of each such batch can be short (then padded). ``source`` (the files) names them in errors.
    """
    streaming = isinstance(dataset, datasets.IterableDataset)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; packing needs one to separate documents")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise KeyError(f"data.text_field {text_field!r} is not a column of the dataset; its columns are {columns}")

    def to_blocks(rows: Mapping[str, list[Any]]) -> dict[str, list[list[int]]]:
        bad = next((v for v in rows[text_field] if not isinstance(v, str)), "") if streaming else ""
        if not isinstance(bad, str):  # a stream is not checked up front (see load_text)
            raise DataError(f"{source or 'the data'}: a record has {text_field}={bad!r}, not a string; every "
                            f"record's {text_field!r} must be text")
        docs = [ids + [eos] for ids in tokenizer(rows[text_field], add_special_tokens=False)["input_ids"]]
        streams = [list(itertools.chain.from_iterable(docs))] if packing else docs
        out: dict[str, list[list[int]]] = {name: [] for name in BLOCK_COLUMNS}
        for ids in streams:
            for block in _blocks_from_ids(ids, block_size, pad):
                for name, values in zip(BLOCK_COLUMNS, block, strict=True):
                    out[name].append(values)
        return out

    kwargs: dict[str, Any] = {"batched": True, "batch_size": MAP_BATCH_SIZE, "remove_columns": columns}
    if isinstance(dataset, datasets.Dataset):
        kwargs.update(num_proc=num_proc, desc=desc)  # progress bar and processes: not for lazy streams
    return dataset.map(to_blocks, **kwargs)


def build_splits(config: DataConfig, tokenizer: PreTrainedTokenizerBase, tokenize=None) -> DataSplits:
    """Load, hold out, tokenise and (optionally) slice both splits as ``config`` says.

    ``tokenize`` replaces :func:`tokenize_to_blocks` (same arguments), e.g. the paired blocks of a teacher with
    another tokenizer (``distill_kit/data/paired_blocks.py``)."""
    tokenize = tokenize or tokenize_to_blocks
    train_text = load_text(config.train, streaming=config.streaming, text_field=config.text_field)
    if config.heldout is not None:
        heldout_text = load_text(config.heldout, streaming=config.streaming, text_field=config.text_field)
    elif config.streaming:
        raise ValueError("streaming needs explicit held-out files (data.heldout): a stream cannot be split by fraction")
    else:
        parts = train_text.train_test_split(test_size=config.heldout_fraction, seed=config.seed)
        train_text, heldout_text = parts["train"], parts["test"]

    def blocks(text: datasets.Dataset | datasets.IterableDataset, limit: int | None, name: str, files: Any):
        tokenised = tokenize(
            text,
            tokenizer,
            block_size=config.block_size,
            packing=config.packing is not False,
            text_field=config.text_field,
            num_proc=config.num_proc,
            desc=f"tokenising {name}",
            source=", ".join(_as_list(files)),
        )
        if limit is None:
            return tokenised
        if isinstance(tokenised, datasets.IterableDataset):
            return tokenised.take(limit)
        return tokenised.select(range(min(limit, len(tokenised))))

    return DataSplits(
        train=blocks(train_text, config.max_train_blocks, "train", config.train),
        heldout=blocks(heldout_text, config.max_heldout_blocks, "held-out", config.heldout or config.train),
    )


@dataclass(frozen=True)
class LoaderPosition:
    """Where a loader is: ``index`` micro-batches of epoch ``epoch`` have been handed out."""

    epoch: int = 0
    index: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, int]) -> LoaderPosition:
        return cls(epoch=int(state["epoch"]), index=int(state["index"]))


def _check_rank(rank: int, world_size: int, micro_batch_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")


def _collate(rows: Mapping[str, Sequence[Sequence[int]]]) -> Batch:
    """Every column of the blocks (more than :data:`BLOCK_COLUMNS` for paired blocks) as int64 tensors."""
    return {name: torch.tensor(values, dtype=torch.long) for name, values in rows.items()}


class EpochLoader:
    """What a loader that cuts each epoch into ``num_batches`` micro-batches shares: iteration from its saved
    :class:`LoaderPosition`, and that position as its state (so a resumed run continues at the same batch).
    A subclass calls ``__init__`` and gives ``epoch_order(epoch)`` and ``batch(epoch, index, order)``."""

    def __init__(self, dataset: datasets.Dataset, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool, drop_last: bool) -> None:
        """The settings every loader keeps, and ``num_batches``: whole global batches of ``world_size *
        micro_batch_size`` rows, plus a last partial one without ``drop_last`` (a subclass checks its data first)."""
        self.dataset = dataset.with_format(None)
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.position = LoaderPosition()
        whole, rest = divmod(len(dataset), world_size * micro_batch_size)
        self.num_batches = whole + (1 if rest and not drop_last else 0)

    def __len__(self) -> int:
        """Micro-batches per epoch, the same on every rank."""
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch from :attr:`position`; the position then moves to the next epoch."""
        epoch = self.position.epoch
        order = self.epoch_order(epoch)
        for index in range(self.position.index, self.num_batches):
            batch = self.batch(epoch, index, order)
            self.position = LoaderPosition(epoch, index + 1)
            yield batch
        self.position = LoaderPosition(epoch + 1, 0)

    def state_dict(self) -> dict[str, int]:
        return self.position.state_dict()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.position = LoaderPosition.from_state_dict(state)


class BlockLoader(EpochLoader):
    """Micro-batches of one rank over a map-style block dataset; every rank gets ``len(self)`` of them.

    Global batch ``b`` of an epoch is blocks ``order[b*W*M : (b+1)*W*M]`` (``W`` ranks, ``M`` blocks a
    micro-batch) and rank ``r`` takes its ``r``-th slice of ``M``, so the ranks together see each block
    of the epoch at most once. With ``drop_last`` (training) the blocks beyond the last whole global
    batch are left out of this epoch (another set each epoch when shuffled); without it (evaluation)
    the last global batch is filled with *filler* blocks whose labels are all -100: they run the
    forward every rank must run and count no token.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        micro_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        _check_rank(rank, world_size, micro_batch_size)
        missing = [name for name in BLOCK_COLUMNS if name not in dataset.column_names]
        if missing:
            raise KeyError(f"dataset lacks column(s) {missing}; build it with tokenize_to_blocks")
        global_batch = world_size * micro_batch_size
        if drop_last and len(dataset) < global_batch:
            raise DataError(
                f"the dataset has {len(dataset)} blocks but one global batch needs world_size ({world_size}) x "
                f"micro_batch_size ({micro_batch_size}) = {global_batch}: use more data, a smaller "
                f"micro-batch or block_size, or fewer ranks"
            )
        if len(dataset) == 0:
            raise DataError("the dataset has no blocks: check the data files and data.text_field")
        super().__init__(dataset, micro_batch_size, rank, world_size, seed, shuffle, drop_last)

    def epoch_order(self, epoch: int) -> list[int]:
        """Block indices of ``epoch`` in the order the ranks consume them, fixed by ``seed`` and ``epoch``."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def _filler(self, count: int) -> dict[str, list[list[int]]]:
        """Blocks that run a normal forward (attention on) but carry no label: copies of block 0, with every
        ``*labels`` column (the teacher's too, in paired blocks) all -100."""
        first = self.dataset[0]
        row = {name: [IGNORE_INDEX] * len(values) if name.endswith("labels") else list(values)
               for name, values in first.items()}
        for name in ("attention_mask", "teacher_attention_mask"):
            if name in row:
                row[name] = [1] * len(row[name])
        return {name: [values] * count for name, values in row.items()}

    def batch(self, epoch: int, index: int, order: Sequence[int] | None = None) -> Batch:
        """Micro-batch ``index`` of ``epoch`` for this rank."""
        order = self.epoch_order(epoch) if order is None else order
        start = (index * self.world_size + self.rank) * self.micro_batch_size
        chosen = list(order[start : start + self.micro_batch_size])
        rows = self.dataset[chosen] if chosen else {name: [] for name in self.dataset.column_names}
        short = self.micro_batch_size - len(chosen)
        if short:
            filler = self._filler(short)
            rows = {name: list(rows[name]) + filler[name] for name in self.dataset.column_names}
        return _collate(rows)



class StreamingBlockLoader:
    """Micro-batches of one rank over a streamed (iterable) block dataset larger than RAM or disk cache.

    A stream's length is unknown until it ends, so every rank reads the whole stream, keeps the blocks
    of its slot in each global batch (as :class:`BlockLoader` does) and yields only *complete* global
    batches: all ranks then yield the same number. The order is the stream's, shuffled through a buffer
    seeded by ``seed`` and the epoch; resuming skips ``position.index`` micro-batches.
    """

    def __init__(
        self,
        dataset: datasets.IterableDataset,
        micro_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 1000,
    ) -> None:
        _check_rank(rank, world_size, micro_batch_size)
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle_buffer = seed, shuffle_buffer
        self.position = LoaderPosition()

    def _epoch_stream(self, epoch: int) -> Iterator[Mapping[str, list[int]]]:
        if self.shuffle_buffer <= 1:
            return iter(self.dataset)
        shuffled = self.dataset.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
        shuffled.set_epoch(epoch)
        return iter(shuffled)

    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self.position.epoch, self.position.index
        global_batch = self.world_size * self.micro_batch_size
        mine = slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)
        stream = self._epoch_stream(epoch)
        index = 0
        while True:
            group = list(itertools.islice(stream, global_batch))
            if len(group) < global_batch:
                if index == 0 and start == 0:
                    raise DataError(
                        f"the stream holds fewer blocks than one global batch of world_size ({self.world_size}) x "
                        f"micro_batch_size ({self.micro_batch_size}): use more data or a smaller micro-batch"
                    )
                break
            if index >= start:
                rows = group[mine]
                self.position = LoaderPosition(epoch, index + 1)
                yield _collate({name: [row[name] for row in rows] for name in rows[0]})
            index += 1
        self.position = LoaderPosition(epoch + 1, 0)

    def state_dict(self) -> dict[str, int]:
        return self.position.state_dict()

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.position = LoaderPosition.from_state_dict(state)
