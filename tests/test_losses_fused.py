"""The fused student head (hidden states + head weight into the loss, logits chunk by chunk) against the plain
path (the head applied in full, then the loss): same values and gradients w.r.t. hidden states, head weight and
bias, for every logit loss, a captured teacher's top k, tied embeddings and mixed losses; and no full logits."""

from types import SimpleNamespace

import pytest
import torch
from spies import linear_rows
from test_losses import LOGIT_LOSSES, build, make_batch
from test_losses_sparse import DIVERGENCES, top_k
from tiny_models import gpt2_config
from transformers import GPT2LMHeadModel

from distill_kit.engines.head import headless_forward, why_not_fused
from losses import DistillationLoss, LossOutput, build_loss
from losses.fused import HeadOutput, fused_head_loss

BATCH, SEQ, HIDDEN, VOCAB = 3, 7, 6, 11


def head(vocab=VOCAB, bias=True, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(HIDDEN, vocab, bias=bias).to(dtype)
    layer.weight.data.mul_(3.0)
    return layer


def fused_vs_plain(loss, teacher, batch, bias=True, dtype=torch.float64):
    """(value, grads of hidden, weight, bias) through the fused path and through full logits."""
    results = []
    for fused in (True, False):
        layer = head(bias=bias, dtype=dtype)
        torch.manual_seed(1)
        hidden = torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype, requires_grad=True)
        student = HeadOutput(hidden, layer) if fused else SimpleNamespace(logits=layer(hidden))
        value = loss(student, teacher, batch).total
        value.backward()
        results.append([value.detach(), hidden.grad, layer.weight.grad] + ([layer.bias.grad] if bias else []))
    return results


@pytest.mark.parametrize("name", LOGIT_LOSSES)
def test_fused_equals_plain_for_every_logit_loss(name):
    """Temperature 2, prompt and padding masks, a teacher vocabulary padded past the student's, chunks of 4."""
    batch = make_batch()
    batch["loss_normalizer"] = torch.tensor(5.0, dtype=torch.float64)  # as the loop sets it under accumulation
    torch.manual_seed(2)
    teacher = 3 * torch.randn(BATCH, SEQ, VOCAB + 3, dtype=torch.float64)
    teacher[..., VOCAB:] = 50.0  # must be cut, or every loss changes
    fused, plain = fused_vs_plain(build(name, chunk_size=4), SimpleNamespace(logits=teacher), batch)
    assert plain[2].abs().max() > 0 and plain[1].abs().max() > 0  # the comparison is not of zeros
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_fused_equals_plain_on_a_captured_top_k(name, tail):
    batch = make_batch()
    torch.manual_seed(3)
    targets = top_k(3 * torch.randn(BATCH, SEQ, VOCAB + 2), k=4, tail=tail)  # ids past VOCAB can occur
    loss = build(name, chunk_size=5, temperature=1.0 if tail else 2.0)
    fused, plain = fused_vs_plain(loss, SimpleNamespace(logits=targets), batch, bias=False)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_float32_and_bf16_stay_close_to_plain():
    batch = make_batch()
    teacher = SimpleNamespace(logits=torch.randn(BATCH, SEQ, VOCAB))
    fused, plain = fused_vs_plain(build("forward_kl", chunk_size=2), teacher, batch, dtype=torch.float32)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fused, plain = fused_vs_plain(build("forward_kl", chunk_size=2), teacher, batch, dtype=torch.bfloat16)
    assert [t.dtype for t in fused[1:]] == [torch.bfloat16] * 3
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def test_gradcheck_through_fused_path():
    batch = make_batch(batch=2, seq=4, vocab=5, seed=2)
    teacher = torch.randn(2, 4, 5, dtype=torch.float64)
    loss = build("generalized_jsd", chunk_size=3)
    rows = torch.tensor([0, 1, 2, 4, 5])
    chunk_loss = loss.chunk_loss(teacher, batch["labels"].reshape(-1))

    def value(hidden, weight, bias):
        return fused_head_loss(hidden, weight, bias, rows, chunk_loss, 2)

    inputs = (torch.randn(8, 3, dtype=torch.float64, requires_grad=True),
              torch.randn(5, 3, dtype=torch.float64, requires_grad=True),
              torch.randn(5, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(value, inputs)


def test_no_full_logits_exist_in_forward_or_for_backward():
    n_tokens, vocab, hidden_size, chunk = 64, 512, 16, 8
    batch = {"input_ids": torch.zeros(1, n_tokens, dtype=torch.long), "attention_mask": torch.ones(1, n_tokens)}
    batch["labels"] = batch["input_ids"]
    layer = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, n_tokens, hidden_size, requires_grad=True)
    teacher = SimpleNamespace(logits=torch.randn(1, n_tokens, vocab))
    loss = build("forward_kl", chunk_size=chunk)
    with linear_rows() as created:
        value = loss(HeadOutput(hidden, layer), teacher, batch).total
    assert created and max(created) <= chunk  # logits were only ever made one chunk at a time
    node = value.grad_fn
    while not node.name().startswith("_FusedHeadLoss"):
        (node, _), *_ = node.next_functions
    kept = [t for t in node.saved_tensors if t is not None]  # what waits for backward: the two gradients only
    assert [t.shape for t in kept] == [hidden.reshape(-1, hidden_size).shape, layer.weight.shape]
    value.backward()
    assert hidden.grad is not None and layer.weight.grad is not None


def test_tied_embeddings_and_a_mixed_loss_match_the_plain_model():
    """A real GPT-2 (head tied to the input embedding) run headless with CE + KL + hidden MSE vs its own logits."""
    torch.manual_seed(4)
    model = GPT2LMHeadModel(gpt2_config(width=16, layers=2, vocab=VOCAB)).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    spec = [{"name": "cross_entropy", "weight": 0.5}, {"name": "forward_kl", "weight": 1.0, "temperature": 2.0},
            {"name": "hidden_mse", "weight": 0.1, "layers": [[1, 1], [2, 2]]}]
    loss = build_loss(spec)
    assert not loss.needs_full_logits
    batch = make_batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "output_hidden_states": True}
    with torch.no_grad():
        teacher = model(**inputs)
        teacher = SimpleNamespace(logits=teacher.logits + torch.randn_like(teacher.logits),
                                  hidden_states=tuple(h + 0.1 for h in teacher.hidden_states))
    grads = []
    for fused in (True, False):
        model.zero_grad()
        student = headless_forward(model, **inputs) if fused else model(**inputs)
        assert isinstance(student, HeadOutput) == fused
        value = loss(student, teacher, batch).total
        value.backward()
        if fused:
            assert student._logits is None  # no term asked for the full logits
        grads.append([value.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


class LogitsNorm(DistillationLoss):
    """A user loss on the full logits, not a ``LogitLoss``: it cannot be fused and says so by default."""

    def forward(self, student, teacher, batch):
        value = student.logits.square().mean()
        return LossOutput(value, {"norm": value.detach()})


def test_a_loss_that_reads_logits_gets_them_from_a_head_output():
    assert LogitsNorm().needs_full_logits
    assert not build_loss("tests.user_losses:HalfForwardKL").needs_full_logits  # a user LogitLoss is fused
    layer = head()
    hidden = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, requires_grad=True)
    LogitsNorm()(HeadOutput(hidden, layer), None, {}).total.backward()
    fused_grad = layer.weight.grad.clone()
    layer.weight.grad = None
    LogitsNorm()(SimpleNamespace(logits=layer(hidden)), None, {}).total.backward()
    torch.testing.assert_close(fused_grad, layer.weight.grad)


def test_no_grad_evaluation_matches():
    batch = make_batch()
    layer = head()
    hidden = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64)
    teacher = SimpleNamespace(logits=torch.randn(BATCH, SEQ, VOCAB, dtype=torch.float64))
    loss = build("reverse_kl", chunk_size=3)
    with torch.no_grad():
        fused = loss(HeadOutput(hidden, layer), teacher, batch).total
        plain = loss(SimpleNamespace(logits=layer(hidden)), teacher, batch).total
    assert not fused.requires_grad
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)


def test_fused_head_is_used_only_where_exact():
    model = GPT2LMHeadModel(gpt2_config(width=16, layers=1))
    kl = build_loss("forward_kl")
    zero2, zero3 = {"zero_optimization": {"stage": 2}}, {"zero_optimization": {"stage": 3}}
    assert why_not_fused(model, kl, zero2, enabled=True) is None
    assert "fused_loss" in why_not_fused(model, kl, zero2, enabled=False)
    assert "ZeRO-3" in why_not_fused(model, kl, zero3, enabled=True)
    assert "full logits" in why_not_fused(model, LogitsNorm(), zero2, enabled=True)
    model.config.model_type = "gemma2"  # soft-caps its logits after the head
    assert "gemma2" in why_not_fused(model, kl, zero2, enabled=True)


@pytest.mark.multirank
def test_distiller_step_fused_equals_plain(tmp_path):
    """Two ranks, ZeRO-2 student and ZeRO-3 teacher, accumulation 2, CE + KL: same parameters, losses, metrics."""
    import json

    from launch import ROOT, run_ranks

    run_ranks(ROOT / "tests/workers/fused_scenarios.py", [str(tmp_path)], nprocs=2)
    for rank in range(2):
        result = json.loads((tmp_path / f"fused.rank{rank}.json").read_text())
        assert result["fused_head_True"] and not result["fused_head_False"]
        assert result["output_True"] == "HeadOutput" and result["output_False"] == "CausalLMOutputWithCrossAttentions"
        assert result["max_param_change"] > 1e-3
        # float32 sums in another order (per chunk, then across chunks): Adam turns the last-bit differences of
        # near-zero gradients into ~1e-6 steps; a wrong gradient anywhere moves parameters by ~1e-3 (lr 3e-3).
        assert result["max_param_diff"] < 5e-6
        assert result["losses_True"] == pytest.approx(result["losses_False"], rel=1e-6)
        for name, metrics in result["eval_True"].items():
            assert metrics == pytest.approx(result["eval_False"][name], rel=1e-6)
