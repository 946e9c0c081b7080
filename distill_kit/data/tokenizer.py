"""Train the embedded default's tokenizer: a small byte-level BPE, saved as a Hugging Face tokenizer.

Why byte-level: every string round-trips (no unknown tokens), whatever the corpus holds.
Why small (about 1k tokens): the default's models are tiny, and with a large vocabulary the
embedding and output head would be most of their parameters and most of a CPU step's time; a
thousand merges already cover Python's keywords, common identifiers and indentation runs.
Saved as a ``PreTrainedTokenizerFast`` directory so ``AutoTokenizer.from_pretrained(path)`` loads it
offline, beside the teacher that was trained with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 1024


def jsonl_texts(path: Path, text_field: str = "text") -> Iterator[str]:
    """The ``text_field`` of each row of a JSON Lines file, read lazily."""
    with path.open(encoding="utf-8") as rows:
        for line in rows:
            yield json.loads(line)[text_field]


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (one of them ``<|endoftext|>``) on ``texts``.

    ``<|endoftext|>`` is the end-of-document token the packer puts between documents, and doubles
    as the padding token (padded positions get label -100, so its id never trains anything there).
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols plus {EOS_TOKEN}, got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def train_and_save(corpus_train: Path, out_dir: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train on a corpus JSON Lines file (see ``distill_kit.data.corpus``) and ``save_pretrained`` it."""
    tokenizer = train_tokenizer(jsonl_texts(corpus_train), vocab_size)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
