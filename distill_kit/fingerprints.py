"""Identities of what a teacher store was made from: teacher, tokenizer and dataset, as sha256 hex digests.

A store is only valid for runs that feed the student the same token ids in the same sequences: another
tokenizer gives the ids other meanings, another dataset other sequences. These digests are written into
the store's manifest at capture and compared when a run opens it, so a mismatch fails at start-up with
both values named, not as a silently wrong loss.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn

from distill_kit.teacher_store import block_key

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
READ_BYTES = 1 << 24  # hash files 16 MiB at a time: a 140 GB teacher never sits in memory


def teacher_fingerprint(source: str | Path | nn.Module, config: Any) -> str:
    """sha256 of a model folder's config and weight files, read whole (once, at capture).

    A module or a hub name has no files here to read; its config stands in, so two different models with
    one config are told apart only by name.
    """
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    folder = None if isinstance(source, nn.Module) else Path(source)
    if folder is not None and folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.suffix in WEIGHT_SUFFIXES:
                digest.update(path.name.encode())
                with path.open("rb") as weights:
                    while chunk := weights.read(READ_BYTES):
                        digest.update(chunk)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the vocabulary (token -> id): what the stored ids mean."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def dataset_fingerprint(blocks: datasets.Dataset, batch_size: int = 1024) -> str:
    """sha256 over the block hashes (``teacher_store.block_key``) of every block, in the dataset's order.

    Content, not ``datasets``' own cache fingerprint: the same text tokenised again on another machine
    (other paths, other file times) gives the same digest, and any changed token a different one.
    """
    digest = hashlib.sha256()
    for rows in blocks.select_columns(["input_ids", "attention_mask"]).with_format("torch").iter(batch_size):
        for ids, mask in zip(rows["input_ids"], rows["attention_mask"], strict=True):
            digest.update(block_key(torch.as_tensor(ids), torch.as_tensor(mask)))
    return f"{digest.hexdigest()}:{len(blocks)}"
