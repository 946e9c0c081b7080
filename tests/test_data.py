"""The data pipeline's promises: no token lost or reordered, -100 on padding, equal batches per rank,
deterministic and resumable order, and errors that name the numbers and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from distill_kit.data.blocks import (
    IGNORE_INDEX,
    BlockLoader,
    DataConfig,
    DataError,
    StreamingBlockLoader,
    build_splits,
    load_text,
    tokenize_to_blocks,
)

EOS = "<eos>"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (plus EOS): expected token streams can be written by hand."""
    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {EOS: 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS)


def ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


DOCS = ["def f(x):\n    return x\n", "import os", "a = 1\nb = 2\nc = a + b\n", "print('hi')"]


def real_tokens(blocks: datasets.Dataset) -> list[int]:
    """All non-padding tokens of the blocks, in order."""
    out: list[int] = []
    for row in blocks:
        out += [tok for tok, keep in zip(row["input_ids"], row["attention_mask"], strict=True) if keep]
    return out


@pytest.mark.parametrize("block_size", [4, 7, 64])
def test_packing_keeps_every_token_in_order(tokenizer, block_size):
    eos = tokenizer.eos_token_id
    expected = [tok for doc in DOCS for tok in ids(tokenizer, doc) + [eos]]
    blocks = tokenize_to_blocks(datasets.Dataset.from_dict({"text": DOCS}), tokenizer, block_size=block_size)
    assert real_tokens(blocks) == expected
    assert all(len(row["input_ids"]) == block_size for row in blocks)
    # Only the last block may be short, and only there is the mask 0.
    assert all(all(row["attention_mask"]) for row in blocks.select(range(len(blocks) - 1)))


def test_padding_has_ignored_labels_and_one_document_per_block(tokenizer):
    blocks = tokenize_to_blocks(datasets.Dataset.from_dict({"text": DOCS}), tokenizer, block_size=16, packing=False)
    eos = tokenizer.eos_token_id
    assert real_tokens(blocks) == [tok for doc in DOCS for tok in ids(tokenizer, doc) + [eos]]
    for row in blocks:
        for tok, mask, label in zip(row["input_ids"], row["attention_mask"], row["labels"], strict=True):
            assert label == (tok if mask else IGNORE_INDEX)
    # The first document (23 characters + EOS) fills blocks 0 and 1; "import os" + EOS (10 tokens)
    # starts block 2 rather than joining the first's tail, and ends in 6 padded positions.
    assert blocks[1]["attention_mask"] == [1] * 8 + [0] * 8
    assert blocks[2]["attention_mask"] == [1] * 10 + [0] * 6


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_gets_the_same_number_of_batches(world_size):
    pairs = [[i, i] for i in range(23)]
    dataset = datasets.Dataset.from_dict({"input_ids": pairs, "attention_mask": [[1, 1]] * 23, "labels": pairs})
    for drop_last in (True, False):
        loaders = [BlockLoader(dataset, 2, rank=r, world_size=world_size, drop_last=drop_last)
                   for r in range(world_size)]
        per_rank = [list(loader) for loader in loaders]
        assert len({len(batches) for batches in per_rank}) == 1
        seen = [int(b["input_ids"][i, 0]) for batches in per_rank for b in batches
                for i in range(2) if b["labels"][i, 0] != IGNORE_INDEX]
        assert len(seen) == len(set(seen))  # no block twice in an epoch
        if not drop_last:  # evaluation: every block once, the rest filler with no labels
            assert sorted(seen) == list(range(23))
        for batches in per_rank:
            assert all(b["input_ids"].shape == (2, 2) and b["input_ids"].dtype == torch.long for b in batches)


def test_order_is_seeded_and_resumable():
    dataset = datasets.Dataset.from_dict(
        {"input_ids": [[i] for i in range(40)], "attention_mask": [[1]] * 40, "labels": [[i] for i in range(40)]}
    )
    first = [b["input_ids"].flatten().tolist() for b in BlockLoader(dataset, 4, seed=3)]
    assert first == [b["input_ids"].flatten().tolist() for b in BlockLoader(dataset, 4, seed=3)]
    assert first != [b["input_ids"].flatten().tolist() for b in BlockLoader(dataset, 4, seed=4)]

    loader = BlockLoader(dataset, 4, seed=3)
    stream = iter(loader)
    for _ in range(3):
        next(stream)
    resumed = BlockLoader(dataset, 4, seed=3)
    resumed.load_state_dict(loader.state_dict())
    assert loader.state_dict() == {"epoch": 0, "index": 3}
    assert [b["input_ids"].flatten().tolist() for b in resumed] == first[3:]
    assert resumed.state_dict() == {"epoch": 1, "index": 0}
    assert [b["input_ids"].flatten().tolist() for b in resumed] != first  # a new epoch, a new order


def test_streaming_loader_gives_equal_complete_batches(tokenizer, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", DOCS * 5)
    stream = tokenize_to_blocks(load_text(str(train), streaming=True), tokenizer, block_size=8)
    counts = []
    for rank in range(3):
        loader = StreamingBlockLoader(stream, 2, rank=rank, world_size=3, shuffle_buffer=0)
        counts.append(sum(1 for _ in loader))
        assert loader.state_dict() == {"epoch": 1, "index": 0}
    total_blocks = sum(1 for _ in stream)
    assert counts == [total_blocks // 6] * 3


def test_build_splits_from_files(tokenizer, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", DOCS * 3)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("x = 1\ny = 2\n")
    splits = build_splits(DataConfig(train=str(train), heldout=str(heldout), block_size=8, max_train_blocks=5),
                          tokenizer)
    assert len(splits.train) == 5
    assert set(splits.heldout.column_names) == {"input_ids", "attention_mask", "labels"}
    # A .txt file is read a line a row: each line is a document ending in EOS.
    assert real_tokens(splits.heldout) == ids(tokenizer, "x = 1") + [0] + ids(tokenizer, "y = 2") + [0]


def test_clear_errors(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_text(str(tmp_path / "nope.jsonl"))
    train = write_jsonl(tmp_path / "train.jsonl", ["ab"])
    with pytest.raises(KeyError, match="'content' is not a column"):
        tokenize_to_blocks(load_text(str(train)), tokenizer, block_size=4, text_field="content")
    small = datasets.Dataset.from_dict({"input_ids": [[1]] * 5, "attention_mask": [[1]] * 5, "labels": [[1]] * 5})
    with pytest.raises(ValueError, match=r"5 blocks .* world_size \(2\) x micro_batch_size \(4\) = 8"):
        BlockLoader(small, 4, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank must be in"):
        BlockLoader(small, 1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="block_size"):
        DataConfig(train="x.jsonl", block_size=1)


@pytest.mark.parametrize(("name", "content", "message"), [
    ("empty.jsonl", b"", r"empty.jsonl is empty"),
    ("empty.txt", b"", r"empty.txt is empty"),
    ("blank.jsonl", b"\n\n", r"blank.jsonl holds no records"),
    ("latin1.txt", "ok\ncaf\u00e9\n".encode("latin-1"), r"latin1.txt is not UTF-8 text: line 2 has the byte 0xe9"),
    ("numbers.jsonl", b'{"text": "a"}\n{"text": 5}\n', r"numbers.jsonl: record 1 .* has text=5, not a string"),
    ("null.jsonl", b'{"text": "a"}\n{"text": null}\n', r"null.jsonl: record 1 .* has text=None, not a string"),
    ("broken.jsonl", b'{"text": "a"\n', r"cannot read data file\(s\) .*broken.jsonl as json: .*JSON parse error"),
])
def test_bad_data_files_are_errors_naming_the_file(tokenizer, tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    config = DataConfig(train=str(tmp_path / name), heldout=str(tmp_path / name), block_size=4)
    with pytest.raises(DataError, match=message):
        build_splits(config, tokenizer)


def test_a_stream_names_the_file_of_a_record_that_is_not_text(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ["ab"])
    with path.open("a") as handle:
        handle.write('{"text": 7}\n')
    splits = build_splits(DataConfig(train=str(path), heldout=str(path), block_size=4, streaming=True), tokenizer)
    with pytest.raises(DataError, match=r"train.jsonl: a record has text=7, not a string"):
        list(splits.train)
