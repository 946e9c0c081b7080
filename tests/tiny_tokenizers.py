"""Byte-level BPEs with hand-picked merges, so that tests know each text's segmentation on both sides."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def bpe(*merges: str, trim_offsets: bool | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE with exactly these merges ("a b" joins a and b), in order."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {EOS: 0} | {char: i + 1 for i, char in enumerate(sorted(alphabet))}
    pairs = []
    for merge in merges:
        left, right = merge.split(" ")
        pairs.append((left, right))
        vocab.setdefault(left + right, len(vocab))
    model = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens([EOS])
    if trim_offsets is not None:
        model.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token=EOS, pad_token=EOS)
