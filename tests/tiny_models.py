"""Small GPT-2s saved with save_pretrained, so tests exercise the real from_pretrained path offline."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 96


def gpt2_config(width: int, layers: int, vocab: int = VOCAB) -> GPT2Config:
    # No dropout: equivalence tests compare engines with a plain loop step by step.
    return GPT2Config(
        vocab_size=vocab, n_embd=width, n_layer=layers, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )


def save_pair(directory: str | Path) -> tuple[Path, Path]:
    """A teacher several times larger than its student, both saved as Hugging Face model directories."""
    directory = Path(directory)
    teacher, student = directory / "teacher", directory / "student"
    torch.manual_seed(1234)
    if not (teacher / "config.json").exists():
        GPT2LMHeadModel(gpt2_config(width=64, layers=3)).save_pretrained(teacher)
    if not (student / "config.json").exists():
        GPT2LMHeadModel(gpt2_config(width=32, layers=1)).save_pretrained(student)
    return teacher, student


def random_batches(count: int, batch: int, length: int, seed: int, vocab: int = VOCAB) -> list[dict]:
    """Micro-batches with ragged right padding (labels -100 and attention 0 past each length)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, length), generator=generator)
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def llama_config(**overrides):
    """A tiny Llama (multi-head attention, tied embeddings), the embedded default teacher's architecture."""
    from transformers import LlamaConfig

    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaConfig(**(values | overrides))


def qwen2_config(**overrides):
    """A tiny Qwen2: grouped-query attention (2 query heads per key-value group), q/k/v biases, untied head."""
    from transformers import Qwen2Config

    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return Qwen2Config(**(values | overrides))


def save_cli_teacher(directory: Path, tokenizer) -> Path:
    """The CLI tests' teacher: a seeded 2-layer GPT-2 over ``tokenizer``, without dropout, saved with it."""
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=48, n_layer=2, n_head=4, n_positions=64,
                               resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
