"""Logit losses against float64 references written straight from their formulas; the chunked path's
gradients against finite differences and against the unchunked computation; its memory bound."""

import weakref
from types import SimpleNamespace

import pytest
import torch

from losses import LOSSES, build_loss, functional
from losses.base import IGNORE_INDEX

LOGIT_LOSSES = [
    "forward_kl",
    "reverse_kl",
    "generalized_jsd",
    "skew_forward_kl",
    "skew_reverse_kl",
    "total_variation",
    "logit_mse",
    "cross_entropy",
    "mutual_kl",
]
PARAMS = {"generalized_jsd": {"beta": 0.3}, "skew_forward_kl": {"alpha": 0.2}, "skew_reverse_kl": {"alpha": 0.2}}
TEMPERATURE = 2.0


def _kl(a, b):
    return (a * (a.log() - b.log())).sum(-1)


# One token's reference from float64 probabilities p (teacher), q (student), raw logits zs, zt, label y.
REFERENCES = {
    "forward_kl": lambda p, q, zs, zt, y: _kl(p, q),
    "reverse_kl": lambda p, q, zs, zt, y: _kl(q, p),
    "generalized_jsd": lambda p, q, zs, zt, y: 0.3 * _kl(p, 0.3 * p + 0.7 * q) + 0.7 * _kl(q, 0.3 * p + 0.7 * q),
    "skew_forward_kl": lambda p, q, zs, zt, y: _kl(p, 0.2 * p + 0.8 * q),
    "skew_reverse_kl": lambda p, q, zs, zt, y: _kl(q, 0.8 * p + 0.2 * q),
    "total_variation": lambda p, q, zs, zt, y: 0.5 * (p - q).abs().sum(-1),
    "logit_mse": lambda p, q, zs, zt, y: ((zs - zt) / TEMPERATURE).pow(2).mean(-1),
    "cross_entropy": lambda p, q, zs, zt, y: -q[y].log(),
    "mutual_kl": lambda p, q, zs, zt, y: _kl(p, q),  # one teacher is one peer
}


def make_batch(batch=3, seq=7, vocab=11, seed=0):
    """Random labels with a prompt (-100) prefix and right padding of different lengths."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(vocab, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    labels = input_ids.clone()
    for b in range(batch):
        length = seq - b  # ragged: row b has b padding tokens
        attention_mask[b, length:] = 0
        labels[b, length:] = IGNORE_INDEX
        labels[b, : 1 + b % 2] = IGNORE_INDEX  # prompt tokens
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def reference(name, student_logits, teacher_logits, batch):
    """float64, per formula: mean over positions t whose next label counts, times T^2, vocab cut."""
    temperature = 1.0 if name == "cross_entropy" else TEMPERATURE
    zs = student_logits.double()
    zt = teacher_logits.double()[..., : zs.shape[-1]]
    labels = batch["labels"]
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            y = labels[b, t + 1]
            if y == IGNORE_INDEX:
                continue
            p = torch.softmax(zt[b, t] / temperature, -1)
            q = torch.softmax(zs[b, t] / temperature, -1)
            total = total + REFERENCES[name](p, q, zs[b, t], zt[b, t], y)
            count += 1
    return total * temperature**2 / count


def build(name, **kwargs):
    params = dict(PARAMS.get(name, {}), **kwargs)
    if name != "cross_entropy":
        params.setdefault("temperature", TEMPERATURE)
    return build_loss({"name": name, **params})


def outputs(logits):
    return SimpleNamespace(logits=logits)


def test_every_registered_logit_loss_is_tested():
    from losses.base import LogitLoss

    # policy_gradient reads the batch's advantages and its sampled tokens, not a divergence of two distributions: its
    # float64 references are tests/test_rewards_math.py's
    assert {n for n, cls in LOSSES.items() if issubclass(cls, LogitLoss)} == set(LOGIT_LOSSES) | {"policy_gradient"}


@pytest.mark.parametrize("name", LOGIT_LOSSES)
def test_matches_float64_reference_value_and_gradient(name):
    batch = make_batch()
    torch.manual_seed(1)
    student = (3 * torch.randn(3, 7, 11)).requires_grad_()
    teacher = 3 * torch.randn(3, 7, 14)
    teacher[..., 11:] = 50.0  # padded teacher vocabulary: must be cut, or every loss changes
    loss = build(name, chunk_size=4)(outputs(student), outputs(teacher), batch).total
    loss.backward()

    student64 = student.detach().double().requires_grad_()
    expected = reference(name, student64, teacher, batch)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(student.grad.double(), student64.grad, rtol=1e-4, atol=1e-6)
    assert loss.dtype == torch.float32


@pytest.mark.parametrize("name", LOGIT_LOSSES)
def test_gradcheck_through_chunked_path(name):
    batch = make_batch(batch=2, seq=4, vocab=5, seed=2)
    torch.manual_seed(3)
    teacher = torch.randn(2, 4, 5, dtype=torch.float64)
    loss = build(name, chunk_size=2)
    student = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: loss(outputs(s), outputs(teacher), batch).total, (student,))


@pytest.mark.parametrize("name", LOGIT_LOSSES)
def test_chunked_equals_unchunked(name):
    batch = make_batch(batch=4, seq=9, vocab=32, seed=4)
    torch.manual_seed(5)
    student = torch.randn(4, 9, 32)
    teacher = torch.randn(4, 9, 32)
    results = []
    for chunk_size in (1, 5, 10**6):
        s = student.clone().requires_grad_()
        value = build(name, chunk_size=chunk_size)(outputs(s), outputs(teacher), batch).total
        value.backward()
        results.append((value.detach(), s.grad))
    for value, grad in results[:-1]:
        torch.testing.assert_close(value, results[-1][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, results[-1][1], rtol=1e-6, atol=1e-8)


def test_teacher_is_never_differentiated():
    batch = make_batch()
    student = torch.randn(3, 7, 11, requires_grad=True)
    teacher = torch.randn(3, 7, 11, requires_grad=True)
    build("forward_kl")(outputs(student), outputs(teacher), batch).total.backward()
    assert teacher.grad is None and student.grad is not None


def _live_saved_tensors(fn):
    """Run ``fn`` and return it with the tensors autograd saved during it that are still alive after it:
    what stays in memory until backward. Per-chunk graphs freed inside ``fn`` do not count."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t):
        result = fn()
    return result, [t for t in (ref() for ref in saved) if t is not None]


def test_chunked_path_keeps_no_float32_copy_of_the_logits():
    n_tokens, vocab, chunk = 64, 512, 8
    batch = {"input_ids": torch.zeros(1, n_tokens, dtype=torch.long), "attention_mask": torch.ones(1, n_tokens)}
    batch["labels"] = batch["input_ids"]
    student = torch.randn(1, n_tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    teacher = torch.randn(1, n_tokens, vocab, dtype=torch.bfloat16)

    def float32_elements(saved):
        return sum(t.numel() for t in saved if t.dtype == torch.float32)

    # The check can fail: plain autograd keeps float32 (n, V) tensors alive for backward.
    _, plain = _live_saved_tensors(lambda: functional.forward_kl(student.float(), teacher.float()).sum())
    assert float32_elements(plain) >= n_tokens * vocab

    loss = build("forward_kl", chunk_size=chunk)
    _, saved = _live_saved_tensors(lambda: loss(outputs(student), outputs(teacher), batch).total)
    assert float32_elements(saved) < chunk * vocab
    assert sum(t.numel() for t in saved if t.dtype == torch.bfloat16) <= n_tokens * vocab  # the gradient only


def test_bf16_logits_give_bf16_gradient_close_to_float32():
    batch = make_batch(vocab=64)
    torch.manual_seed(6)
    student = torch.randn(3, 7, 64).to(torch.bfloat16).requires_grad_()
    teacher = torch.randn(3, 7, 64).to(torch.bfloat16)
    loss = build("forward_kl")
    loss(outputs(student), outputs(teacher), batch).total.backward()
    student32 = student.detach().float().requires_grad_()
    expected = loss(outputs(student32), outputs(teacher.float()), batch).total
    expected.backward()
    assert student.grad.dtype == torch.bfloat16
    torch.testing.assert_close(student.grad.float(), student32.grad, rtol=2e-2, atol=1e-4)


def test_no_grad_evaluation_matches_and_builds_no_gradient():
    batch = make_batch()
    student = torch.randn(3, 7, 11, requires_grad=True)
    teacher = torch.randn(3, 7, 11)
    loss = build("reverse_kl", chunk_size=3)
    with torch.no_grad():
        value, saved = _live_saved_tensors(lambda: loss(outputs(student), outputs(teacher), batch).total)
    assert saved == [] and not value.requires_grad
    torch.testing.assert_close(value, loss(outputs(student), outputs(teacher), batch).total.detach())


def test_generalized_jsd_endpoints_are_the_kls():
    torch.manual_seed(7)
    s, t = torch.randn(6, 9, dtype=torch.float64), torch.randn(6, 9, dtype=torch.float64)
    assert torch.equal(functional.generalized_jsd(s, t, 0.0), functional.forward_kl(s, t))
    assert torch.equal(functional.generalized_jsd(s, t, 1.0), functional.reverse_kl(s, t))
    # ... and they are the limits of the normalised mixture formula, JSD/beta and JSD/(1 - beta).
    eps = 1e-5
    torch.testing.assert_close(
        functional.generalized_jsd(s, t, eps) / eps, functional.forward_kl(s, t), rtol=1e-3, atol=0
    )
    torch.testing.assert_close(
        functional.generalized_jsd(s, t, 1 - eps) / eps, functional.reverse_kl(s, t), rtol=1e-3, atol=0
    )
    assert torch.equal(functional.skew_forward_kl(s, t, 0.0), functional.forward_kl(s, t))
    assert torch.equal(functional.skew_reverse_kl(s, t, 0.0), functional.reverse_kl(s, t))


def test_mixtures_stay_finite_when_probabilities_underflow():
    s = torch.tensor([[0.0, -1e4, 0.0]])
    t = torch.tensor([[-1e4, 0.0, 0.0]])
    for beta in (0.1, 0.5, 0.9):
        assert torch.isfinite(functional.generalized_jsd(s, t, beta)).all()
    assert torch.isfinite(functional.skew_forward_kl(s, t, 0.1)).all()
    assert torch.isfinite(functional.skew_reverse_kl(s, t, 0.1)).all()


def test_t2_scaling_is_switchable():
    batch = make_batch()
    student, teacher = torch.randn(3, 7, 11), torch.randn(3, 7, 11)
    scaled = build("forward_kl")(outputs(student), outputs(teacher), batch).total
    unscaled = build("forward_kl", scale_by_t2=False)(outputs(student), outputs(teacher), batch).total
    torch.testing.assert_close(scaled, unscaled * TEMPERATURE**2)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "generalized_jsd", "beta": 1.5}, r"beta must be in \[0, 1\]"),
        ({"name": "skew_forward_kl", "alpha": 1.0}, r"alpha must be in \[0, 1\)"),
        ({"name": "skew_reverse_kl", "alpha": -0.1}, r"alpha must be in \[0, 1\)"),
        ({"name": "forward_kl", "temperature": 0}, "temperature must be > 0"),
        ({"name": "cross_entropy", "temperature": 2.0}, "bad parameters for loss 'cross_entropy'"),
    ],
)
def test_bad_parameters_fail_at_construction(spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_loss(spec)


@pytest.mark.parametrize("name", LOGIT_LOSSES)
def test_a_batch_with_no_counted_token_gives_zero_and_a_zero_gradient(name):
    batch = make_batch()
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    student = torch.randn(3, 7, 11, requires_grad=True)
    value = build(name)(outputs(student), outputs(torch.randn(3, 7, 11)), batch).total
    value.backward()
    assert value.item() == 0.0 and torch.count_nonzero(student.grad) == 0
