"""Logit losses on a captured teacher's top-k targets against float64 references written from the formulas:
renormalised over k, and with the tail bucket; k = V equals the dense loss; gradients; refusals."""

from types import SimpleNamespace

import pytest
import torch
from test_losses import make_batch

from losses import build_loss
from losses.base import IGNORE_INDEX
from losses.sparse import SparseTeacherLogits

DIVERGENCES = ["forward_kl", "reverse_kl", "generalized_jsd", "skew_forward_kl", "skew_reverse_kl", "total_variation"]
PARAMS = {"generalized_jsd": {"beta": 0.3}, "skew_forward_kl": {"alpha": 0.2}, "skew_reverse_kl": {"alpha": 0.2}}
VOCAB, K = 11, 4


def _kl(a, b):
    return (a * (a.log() - b.log())).sum(-1)


REFERENCES = {  # p teacher, q student: float64 probabilities over the same outcomes
    "forward_kl": lambda p, q: _kl(p, q),
    "reverse_kl": lambda p, q: _kl(q, p),
    "generalized_jsd": lambda p, q: 0.3 * _kl(p, 0.3 * p + 0.7 * q) + 0.7 * _kl(q, 0.3 * p + 0.7 * q),
    "skew_forward_kl": lambda p, q: _kl(p, 0.2 * p + 0.8 * q),
    "skew_reverse_kl": lambda p, q: _kl(q, 0.8 * p + 0.2 * q),
    "total_variation": lambda p, q: 0.5 * (p - q).abs().sum(-1),
}


def top_k(teacher_logits, k, tail):
    """What a capture stores: top-k log-probabilities at T = 1, their ids, the log of the rest."""
    log_p = torch.log_softmax(teacher_logits.double(), -1)
    values, ids = log_p.topk(k, dim=-1)
    log_tail = torch.log1p(-values.exp().sum(-1).clamp(max=1.0)) if tail else None
    return SparseTeacherLogits(values.float(), ids, None if log_tail is None else log_tail.float())


def reference(name, student_logits, targets, batch, temperature):
    """Mean over counted positions, times T^2, from probabilities: p_i and q_i on the k ids, renormalised,
    or with p_tail = 1 - sum_k p and q_tail = 1 - sum_k q as a (k+1)-th outcome."""
    zs = student_logits.double()
    total, count = 0.0, 0
    labels = batch["labels"]
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            if labels[b, t + 1] == IGNORE_INDEX:
                continue
            ids = targets.ids[b, t]
            p = torch.softmax(targets.log_probs[b, t].double() / temperature, -1)  # renormalised tempered p
            q_full = torch.softmax(zs[b, t] / temperature, -1)
            if targets.log_tail is None:
                q = q_full[ids] / q_full[ids].sum()
            else:
                p = torch.cat([targets.log_probs[b, t].double().exp(), targets.log_tail[b, t, None].double().exp()])
                q = torch.cat([q_full[ids], 1 - q_full[ids].sum(-1, keepdim=True)])
            total = total + REFERENCES[name](p, q)
            count += 1
    return total * temperature**2 / count


@pytest.mark.parametrize("tail", [False, True], ids=["renormalised", "tail_bucket"])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_top_k_matches_float64_reference(name, tail):
    batch = make_batch(vocab=VOCAB)
    torch.manual_seed(1)
    student = (3 * torch.randn(3, 7, VOCAB)).requires_grad_()
    targets = top_k(3 * torch.randn(3, 7, VOCAB), K, tail)
    temperature = 1.0 if tail else 2.0
    loss = build_loss({"name": name, "temperature": temperature, "chunk_size": 4, **PARAMS.get(name, {})})
    value = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=targets), batch).total
    value.backward()
    student64 = student.detach().double().requires_grad_()
    expected = reference(name, student64, targets, batch, temperature)
    expected.backward()
    torch.testing.assert_close(value.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(student.grad.double(), student64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tail", [False, True], ids=["renormalised", "tail_bucket"])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_full_vocabulary_top_k_equals_dense(name, tail):
    """k = V keeps the whole distribution: value and gradient equal the live teacher's."""
    batch = make_batch(vocab=VOCAB, seed=3)
    torch.manual_seed(2)
    student = torch.randn(3, 7, VOCAB)
    teacher = torch.randn(3, 7, VOCAB)
    targets = SparseTeacherLogits(*torch.log_softmax(teacher, -1).topk(VOCAB, dim=-1),
                                  torch.full((3, 7), float("-inf")) if tail else None)
    loss = build_loss({"name": name, "temperature": 1.0, **PARAMS.get(name, {})})
    results = []
    for teacher_logits in (teacher, targets):
        s = student.clone().requires_grad_()
        value = loss(SimpleNamespace(logits=s), SimpleNamespace(logits=teacher_logits), batch).total
        value.backward()
        results.append((value.detach(), s.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tail", [False, True], ids=["renormalised", "tail_bucket"])
def test_gradcheck_top_k(tail):
    batch = make_batch(batch=2, seq=3, vocab=5, seed=2)
    torch.manual_seed(3)
    targets = top_k(torch.randn(2, 3, 5), 3, tail)
    targets = SparseTeacherLogits(targets.log_probs.double(), targets.ids,
                                  None if targets.log_tail is None else targets.log_tail.double())
    loss = build_loss({"name": "generalized_jsd", "beta": 0.4, "chunk_size": 3})
    student = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda s: loss(SimpleNamespace(logits=s), SimpleNamespace(logits=targets), batch).total, (student,)
    )


def test_ids_past_the_student_vocabulary_are_dropped_like_the_dense_cut():
    """A teacher padded past the student's vocabulary: its extra ids count for neither side."""
    batch = make_batch(vocab=VOCAB, seed=5)
    torch.manual_seed(4)
    student = torch.randn(3, 7, VOCAB)
    teacher = torch.randn(3, 7, VOCAB + 3)
    log_p = torch.log_softmax(teacher, -1)
    targets = SparseTeacherLogits(*log_p.topk(VOCAB + 3, dim=-1))
    loss = build_loss("forward_kl")
    dense = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=teacher), batch).total
    sparse = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=targets), batch).total
    torch.testing.assert_close(sparse, dense)


def test_cross_entropy_ignores_the_captured_teacher():
    batch = make_batch(vocab=VOCAB)
    student = torch.randn(3, 7, VOCAB)
    targets = top_k(torch.randn(3, 7, VOCAB), K, tail=True)
    loss = build_loss("cross_entropy")
    with_store = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=targets), batch).total
    live = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=torch.randn(3, 7, VOCAB)), batch).total
    torch.testing.assert_close(with_store, live)


def test_refusals_name_the_fix():
    batch = make_batch(vocab=VOCAB)
    student = SimpleNamespace(logits=torch.randn(3, 7, VOCAB))
    with pytest.raises(ValueError, match="logit_mse|LogitMSE.*top-k"):
        build_loss("logit_mse")(student, SimpleNamespace(logits=top_k(torch.randn(3, 7, VOCAB), K, False)), batch)
    with pytest.raises(ValueError, match="tail_bucket=False"):
        build_loss({"name": "forward_kl", "temperature": 2.0})(
            student, SimpleNamespace(logits=top_k(torch.randn(3, 7, VOCAB), K, True)), batch
        )
