"""Identities of what a teacher store was made from: tokenizer and dataset, as sha256 hex digests.

A store is only valid for runs that feed the student the same token ids in the same sequences: another
tokenizer gives the ids other meanings, another dataset other sequences. These digests are written into
the store's manifest at capture and compared when a run opens it, so a mismatch fails at start-up with
both values named, not as a silently wrong loss. The teacher's identity is ``fingerprint.teacher_fingerprint``,
the one checkpoints record.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import datasets
import torch

from distill_kit.offline.store import block_key


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
