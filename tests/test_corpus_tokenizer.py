"""The default's tokenizer: trained offline, saved, reloaded by AutoTokenizer, lossless on any text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from distill_kit.data.tokenizer import EOS_TOKEN, train_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 50


def test_trained_tokenizer_round_trips_and_reloads(tmp_path):
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    assert len(tokenizer) <= 300 and tokenizer.eos_token == tokenizer.pad_token == EOS_TOKEN
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    unseen = "λ = 'héllo'\t# never seen\r\n"  # byte-level: no unknown token, whatever the text
    ids = reloaded(unseen, add_special_tokens=False)["input_ids"]
    assert reloaded.decode(ids) == unseen
    assert ids == tokenizer(unseen, add_special_tokens=False)["input_ids"]
    # Merges learned: common code compresses below one token per byte.
    assert len(reloaded(TEXTS[0])["input_ids"]) < len(TEXTS[0].encode())


def test_vocab_too_small_is_an_error():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(TEXTS, vocab_size=100)
