"""Gradient accumulation does not change any loss: one micro-batch of 8 sequences and 4 accumulated
micro-batches of 2 (each padded to its own length) give the same value and the same gradients, when
``loss_normalizer`` is set as ``losses/base.py`` describes and micro-batch losses are averaged as
DeepSpeed does."""

import math
from itertools import chain
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from losses import LOSSES, build_loss
from losses.base import IGNORE_INDEX

VOCAB, HEADS = 13, 2
FACTS = {"student_hidden_size": 8, "teacher_hidden_size": 12, "student_num_layers": 2, "teacher_num_layers": 4}


class TinyLM(nn.Module):
    """A few attention-like layers, enough to return logits, hidden states and causal attention maps."""

    def __init__(self, width, layers, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)
        self.double()

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        batch, seq, width = h.shape
        allowed = torch.ones(seq, seq, dtype=torch.bool).tril() & attention_mask[:, None, None, :].bool()
        states, maps = [h], []
        for layer in self.mix:
            x = h.view(batch, seq, HEADS, -1).transpose(1, 2)  # (B, heads, T, d)
            scores = x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1])
            attention = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            h = h + torch.tanh(layer((attention @ x).transpose(1, 2).reshape(batch, seq, width)))
            states.append(h)
            maps.append(attention)
        return SimpleNamespace(logits=self.head(h), hidden_states=tuple(states), attentions=tuple(maps))


def sequences():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        ids = torch.randint(1, VOCAB, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g)
        labels = ids.clone()
        labels[: 1 + i % 2] = IGNORE_INDEX  # a prompt of 1 or 2 tokens
        out.append((ids, labels))
    return out


def collate(seqs):
    """Right-pad to this micro-batch's own longest sequence."""
    length = max(len(ids) for ids, _ in seqs)
    batch = {k: torch.full((len(seqs), length), fill) for k, fill in (("input_ids", 0), ("labels", IGNORE_INDEX))}
    batch["attention_mask"] = torch.zeros(len(seqs), length, dtype=torch.long)
    for row, (ids, labels) in enumerate(seqs):
        batch["input_ids"][row, : len(ids)] = ids
        batch["labels"][row, : len(ids)] = labels
        batch["attention_mask"][row, : len(ids)] = 1
    return batch


def accumulate(spec, micro_batch_size, set_normalizer=True):
    """One optimizer step's loss and gradients (student and loss parameters), DeepSpeed-style."""
    student, teacher = TinyLM(8, 2, seed=0), TinyLM(12, 4, seed=1)
    torch.manual_seed(2)
    loss = build_loss(spec, **FACTS).double()
    seqs = sequences()
    valid_tokens = sum(int((labels[1:] != IGNORE_INDEX).sum()) for _, labels in seqs)
    micro_batches = [seqs[i : i + micro_batch_size] for i in range(0, len(seqs), micro_batch_size)]
    value = 0.0
    for micro in micro_batches:
        batch = collate(micro)
        if set_normalizer:
            batch["loss_normalizer"] = valid_tokens / len(micro_batches)
        with torch.no_grad():
            teacher_out = teacher(batch["input_ids"], batch["attention_mask"])
        out = loss(student(batch["input_ids"], batch["attention_mask"]), teacher_out, batch)
        (out.total / len(micro_batches)).backward()  # DeepSpeed averages micro-batch losses
        value += out.total.item() / len(micro_batches)
    return value, [p.grad for p in chain(student.parameters(), loss.parameters())]


COMPOSITE = [
    {"name": "cross_entropy", "weight": 0.5},
    {"name": "generalized_jsd", "weight": 0.5, "temperature": 2.0},
    {"name": "hidden_mse", "weight": 0.1},
    {"name": "attention_kl", "weight": 0.1},
]


# cross_tokenizer reads paired batches (the teacher's own ids and the alignment), which this model and batch do not
# have; its invariance under accumulation is checked against a plain loop with accumulation in
# tests/test_cross_tokenizer_ranks.py.
SAME_BATCH_LOSSES = sorted(set(LOSSES) - {"cross_tokenizer"})


@pytest.mark.parametrize("spec", [*SAME_BATCH_LOSSES, COMPOSITE], ids=[*SAME_BATCH_LOSSES, "composite"])
def test_one_micro_batch_of_8_equals_4_accumulated_micro_batches_of_2(spec):
    value_8, grads_8 = accumulate(spec, micro_batch_size=8)
    value_2, grads_2 = accumulate(spec, micro_batch_size=2)
    assert value_8 > 0
    assert value_2 == pytest.approx(value_8, rel=1e-12)
    assert len(grads_8) == len(grads_2)
    for g8, g2 in zip(grads_8, grads_2, strict=True):
        torch.testing.assert_close(g2, g8, rtol=1e-10, atol=1e-12)


def test_the_invariance_check_can_fail_without_the_normalizer():
    value_8, _ = accumulate("forward_kl", micro_batch_size=8, set_normalizer=False)
    value_2, _ = accumulate("forward_kl", micro_batch_size=2, set_normalizer=False)
    assert value_2 != pytest.approx(value_8, rel=1e-6)
