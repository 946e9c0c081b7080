"""Hidden-state and attention-map losses against float64 references; layer maps, projection, errors."""

from types import SimpleNamespace

import pytest
import torch

from losses import build_loss
from losses.base import IGNORE_INDEX
from losses.layer_map import uniform_layer_map

B, T = 2, 6


def make_batch():
    labels = torch.randint(10, (B, T), generator=torch.Generator().manual_seed(0))
    labels[0, :2] = IGNORE_INDEX  # prompt
    labels[1, 4:] = IGNORE_INDEX  # padding
    attention_mask = (labels != IGNORE_INDEX).long()
    attention_mask[0] = 1
    return {"input_ids": labels.clamp(min=0), "attention_mask": attention_mask, "labels": labels}


def counted(batch):
    """(b, t) pairs whose next label counts, written out by hand."""
    labels = batch["labels"]
    return [(b, t) for b in range(B) for t in range(T - 1) if labels[b, t + 1] != IGNORE_INDEX]


def hidden_states(layers, width, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, width, generator=g, dtype=dtype) for _ in range(layers + 1))


def attention_maps(layers, heads, seed, dtype=torch.float64):
    """Causal attention distributions, so masked entries are exactly zero as in a real model."""
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    maps = []
    for _ in range(layers):
        scores = torch.randn(B, heads, T, T, generator=g, dtype=dtype).masked_fill(~causal, float("-inf"))
        maps.append(scores.softmax(-1))
    return tuple(maps)


def test_uniform_layer_map_takes_every_kth_layer_last_onto_last():
    assert uniform_layer_map(4, 12) == [(1, 3), (2, 6), (3, 9), (4, 12)]
    assert uniform_layer_map(3, 8) == [(1, 2), (2, 5), (3, 8)]
    assert uniform_layer_map(2, 2) == [(1, 1), (2, 2)]


@pytest.mark.parametrize("name", ["hidden_mse", "hidden_cosine"])
def test_hidden_loss_matches_float64_reference_with_projection(name):
    batch = make_batch()
    loss = build_loss(
        name, student_num_layers=2, teacher_num_layers=4, student_hidden_size=3, teacher_hidden_size=5
    ).double()
    student, teacher = hidden_states(2, 3, seed=1), hidden_states(4, 5, seed=2)
    value = loss(SimpleNamespace(hidden_states=student), SimpleNamespace(hidden_states=teacher), batch).total

    w, bias = loss.projection.weight.detach(), loss.projection.bias.detach()
    pairs, positions = [(1, 2), (2, 4)], counted(batch)
    expected = 0.0
    for i, j in pairs:
        for b, t in positions:
            s, h = w @ student[i][b, t] + bias, teacher[j][b, t]
            if name == "hidden_mse":
                expected += ((s - h) ** 2).sum() / len(h)
            else:
                expected += 1 - (s @ h) / (s.norm() * h.norm())
    torch.testing.assert_close(value, expected / len(pairs) / len(positions))


@pytest.mark.parametrize("name", ["hidden_mse", "hidden_cosine"])
def test_hidden_loss_gradcheck_through_states_and_projection(name):
    batch = make_batch()
    loss = build_loss({"name": name, "layers": [[0, 0], [2, 3]]}, student_hidden_size=3, teacher_hidden_size=4).double()
    teacher = hidden_states(3, 4, seed=3)
    first, middle, last = hidden_states(2, 3, seed=4)
    params = (
        last.requires_grad_(),
        loss.projection.weight.detach().requires_grad_(),
        loss.projection.bias.detach().requires_grad_(),
    )

    def value(last, weight, bias):
        student = SimpleNamespace(hidden_states=(first, middle, last))
        projection = {"projection.weight": weight, "projection.bias": bias}
        args = (student, SimpleNamespace(hidden_states=teacher), batch)
        return torch.func.functional_call(loss, projection, args).total

    assert torch.autograd.gradcheck(value, params)


def test_projection_is_a_parameter_of_the_loss_and_absent_when_widths_match():
    loss = build_loss(
        "hidden_mse", student_num_layers=2, teacher_num_layers=4, student_hidden_size=8, teacher_hidden_size=16
    )
    assert {n for n, _ in loss.named_parameters()} == {"projection.weight", "projection.bias"}
    same = build_loss(
        "hidden_mse", student_num_layers=2, teacher_num_layers=4, student_hidden_size=8, teacher_hidden_size=8
    )
    assert list(same.parameters()) == []


def test_hidden_loss_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"student layer 5 is out of range; valid student hidden states .* 0\.\.2"):
        build_loss({"name": "hidden_mse", "layers": [[5, 1]]}, student_num_layers=2, teacher_num_layers=4)
    with pytest.raises(ValueError, match="needs student_num_layers and teacher_num_layers"):
        build_loss("hidden_mse")
    loss = build_loss({"name": "hidden_mse", "layers": [[2, 4]]})  # no widths given: no projection
    batch = make_batch()
    with pytest.raises(ValueError, match="student_hidden_size and teacher_hidden_size"):
        loss(
            SimpleNamespace(hidden_states=hidden_states(2, 3, 0)),
            SimpleNamespace(hidden_states=hidden_states(4, 5, 1)),
            batch,
        )
    with pytest.raises(ValueError, match="teacher layer 4 is out of range; valid teacher hidden states .* 0\\.\\.3"):
        loss(
            SimpleNamespace(hidden_states=hidden_states(2, 3, 0)),
            SimpleNamespace(hidden_states=hidden_states(3, 3, 1)),
            batch,
        )
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        loss(SimpleNamespace(hidden_states=None), SimpleNamespace(hidden_states=hidden_states(4, 3, 1)), batch)


def test_attention_kl_matches_float64_reference():
    batch = make_batch()
    loss = build_loss({"name": "attention_kl", "layers": [[0, 1], [1, 2]]}, student_num_layers=2, teacher_num_layers=3)
    student, teacher = attention_maps(2, 3, seed=5), attention_maps(3, 3, seed=6)
    value = loss(SimpleNamespace(attentions=student), SimpleNamespace(attentions=teacher), batch).total
    positions, expected = counted(batch), 0.0
    for i, j in [(0, 1), (1, 2)]:
        for b, t in positions:
            for h in range(3):
                p, q = teacher[j][b, h, t, : t + 1], student[i][b, h, t, : t + 1]  # the causal support
                expected += (p * (p / q).log()).sum() / 3
    torch.testing.assert_close(value, expected / 2 / len(positions))


def test_attention_kl_default_is_last_layer_and_gradcheck_passes():
    batch = make_batch()
    loss = build_loss("attention_kl", student_num_layers=2, teacher_num_layers=3)
    assert loss.layers == [(1, 2)]
    teacher = attention_maps(3, 2, seed=7)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = torch.randn(B, 2, T, T, dtype=torch.float64, requires_grad=True)

    def value(scores):
        last = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        student = (attention_maps(1, 2, seed=8)[0], last)
        return loss(SimpleNamespace(attentions=student), SimpleNamespace(attentions=teacher), batch).total

    assert torch.autograd.gradcheck(value, (scores,))


def test_attention_kl_errors_name_the_fix():
    batch = make_batch()
    loss = build_loss("attention_kl", student_num_layers=2, teacher_num_layers=2)
    with pytest.raises(ValueError, match="student has 2 heads, teacher 4"):
        loss(
            SimpleNamespace(attentions=attention_maps(2, 2, 0)),
            SimpleNamespace(attentions=attention_maps(2, 4, 1)),
            batch,
        )
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        loss(SimpleNamespace(attentions=(None, None)), SimpleNamespace(attentions=attention_maps(2, 2, 1)), batch)
    with pytest.raises(ValueError, match=r"valid student attentions are 0\.\.1"):
        build_loss({"name": "attention_kl", "layers": [[2, 1]]}, student_num_layers=2, teacher_num_layers=2)


def test_structured_losses_declare_what_they_need():
    assert build_loss("hidden_cosine", student_num_layers=1, teacher_num_layers=1).needs_hidden_states
    assert build_loss("attention_kl", student_num_layers=1, teacher_num_layers=1).needs_attentions
    assert not build_loss("forward_kl").needs_hidden_states
