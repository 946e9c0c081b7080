"""The cross-tokenizer loss against float64 formulas written here from the definitions, by finite differences,
and reduced to forward KL when both sides share one tokenizer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tiny_tokenizers import bpe

from distill_kit.data.alignment import VocabMap
from distill_kit.data.paired_blocks import tokenize_to_paired_blocks
from losses import build_loss, functional
from losses.cross_tokenizer import CrossTokenizer, teacher_token_problems
from losses.divergences import ForwardKL

PAIRS = {0: 3, 1: 0, 2: 5, 4: 4, 6: 8}  # student id -> teacher id of the same text; the rest are unmapped
VS, VT = 7, 9


def hand_batch() -> dict[str, torch.Tensor]:
    """Two sequences, 6 student and 7 teacher positions, every kind of span; one position's label is -100."""
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5, 6], [6, 5, 0, 3, 2, 1]]),
        "teacher_input_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 6], [8, 7, 6, 5, 4, 3, 2]]),
        "align_kind": torch.tensor([[1, 2, 3, 3, 1, 0], [2, 1, 1, 0, 1, 0]]),  # [1, 3]: counted, not compared
        "align_teacher_row": torch.tensor([[0, 1, 3, 3, 4, 0], [0, 2, 3, 4, 5, 0]]),
        "align_teacher_last": torch.tensor([[0, 2, 3, 3, 4, 0], [1, 2, 3, 4, 5, 0]]),
    }
    batch["labels"] = batch["input_ids"].clone()
    batch["labels"][1, 5] = -100  # row 4 of sequence 1 predicts nothing
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def reference(student: torch.Tensor, teacher: torch.Tensor, batch, temperature: float, uld_weight: float,
              bucket: bool = False, unmapped_uld_weight: float = 0.0) -> float:
    """The loss per counted student token, from the definitions, one position at a time in float64."""
    total, count = 0.0, 0
    for b in range(student.shape[0]):
        for r in range(student.shape[1] - 1):
            if batch["labels"][b, r + 1] == -100:
                continue
            count += 1
            kind, row = int(batch["align_kind"][b, r]), int(batch["align_teacher_row"][b, r])
            q = torch.softmax(student[b, r].double() / temperature, -1).tolist()
            if kind == 2:  # P(span) = product of the teacher's probabilities of the span's teacher tokens
                last = int(batch["align_teacher_last"][b, r])
                big_p = math.prod(torch.softmax(teacher[b, j].double() / temperature, -1)[
                    batch["teacher_input_ids"][b, j + 1]].item() for j in range(row, last + 1))
                small_q = q[int(batch["input_ids"][b, r + 1])]
                total += big_p * math.log(big_p / small_q) + (1 - big_p) * math.log((1 - big_p) / (1 - small_q))
                continue
            p = torch.softmax(teacher[b, row].double() / temperature, -1).tolist()
            unmapped_q = sorted((q[i] for i in range(len(q)) if i not in PAIRS), reverse=True)
            unmapped_p = sorted((p[i] for i in range(len(p)) if i not in PAIRS.values()), reverse=True)
            if kind == 1:
                p_shared, q_shared = sum(p[t] for t in PAIRS.values()), sum(q[s] for s in PAIRS)
                if bucket:  # the shared tokens as they are, and the rest as one more outcome
                    kl = sum(p[t] * math.log(p[t] / q[s]) for s, t in PAIRS.items())
                    kl += (1 - p_shared) * math.log((1 - p_shared) / (1 - q_shared))
                else:  # both renormalised over the shared tokens
                    kl = sum(p[t] / p_shared * math.log((p[t] / p_shared) / (q[s] / q_shared))
                             for s, t in PAIRS.items())
                width = max(len(unmapped_p), len(unmapped_q))
                unmapped_p += [0.0] * (width - len(unmapped_p))
                unmapped_q += [0.0] * (width - len(unmapped_q))
                total += kl + unmapped_uld_weight * sum(abs(a - c) for a, c in zip(unmapped_q, unmapped_p, strict=True))
            elif kind == 3:
                sq, sp = sorted(q, reverse=True), sorted(p, reverse=True) + []
                sq += [0.0] * (len(sp) - len(sq))
                total += uld_weight * sum(abs(a - c) for a, c in zip(sq, sp, strict=True))
    return total * temperature**2 / count


def vocab_map() -> VocabMap:
    return VocabMap(tuple(PAIRS), tuple(PAIRS.values()))


@pytest.mark.parametrize("temperature,uld_weight,chunk_size,unmapped,unmapped_uld_weight", [
    (1.0, 1.0, 1024, "renormalise", 0.0), (2.0, 0.5, 3, "bucket", 1.0), (0.7, 0.0, 1, "bucket", 0.0),
    (1.3, 2.0, 2, "renormalise", 0.5)])
def test_matches_float64_reference(temperature, uld_weight, chunk_size, unmapped, unmapped_uld_weight):
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 6, VS, generator=generator, dtype=torch.float64) * 2
    teacher = torch.randn(2, 7, VT, generator=generator, dtype=torch.float64) * 2
    batch = hand_batch()
    loss = CrossTokenizer(vocab_map(), temperature=temperature, uld_weight=uld_weight, chunk_size=chunk_size,
                          unmapped=unmapped, unmapped_uld_weight=unmapped_uld_weight)
    value = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=teacher), batch).total
    expected = reference(student, teacher, batch, temperature, uld_weight, unmapped == "bucket", unmapped_uld_weight)
    assert value.item() == pytest.approx(expected, rel=1e-10)


def test_gradient_matches_finite_differences():
    generator = torch.Generator().manual_seed(1)
    student = torch.randn(2, 6, VS, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 7, VT, generator=generator, dtype=torch.float64)
    batch = hand_batch()
    for options in ({}, {"unmapped": "bucket", "unmapped_uld_weight": 1.0}):
        loss = CrossTokenizer(vocab_map(), temperature=1.5, chunk_size=4, **options)
        assert torch.autograd.gradcheck(
            lambda s, loss=loss: loss(SimpleNamespace(logits=s), SimpleNamespace(logits=teacher), batch).total,
            (student,))


def test_one_tokenizer_on_both_sides_is_forward_kl_exactly():
    import datasets

    tokenizer = bpe("h e", "l l", "he ll", "hell o", "Ġ hello")
    data = datasets.Dataset.from_dict({"text": ["hello hello héllo", "oh, hello\n  x"]})
    blocks = tokenize_to_paired_blocks(data, tokenizer, teacher_tokenizer=tokenizer, block_size=8)
    batch = {k: torch.tensor(v) for k, v in blocks[:].items()}
    counted = batch["labels"][:, 1:] != -100  # every position that predicts a token is one token to one
    assert (batch["align_kind"][:, :-1][counted] == 1).all()
    assert torch.equal(batch["teacher_input_ids"], batch["input_ids"])
    vocab = len(tokenizer)
    generator = torch.Generator().manual_seed(2)
    student = torch.randn(*batch["input_ids"].shape, vocab, generator=generator, dtype=torch.float64)
    teacher = torch.randn(*batch["input_ids"].shape, vocab, generator=generator, dtype=torch.float64)
    for temperature, unmapped in ((1.0, "renormalise"), (2.0, "renormalise"), (1.0, "bucket")):
        cross = CrossTokenizer(VocabMap.build(tokenizer, tokenizer), temperature=temperature, unmapped=unmapped,
                               unmapped_uld_weight=1.0)
        plain = ForwardKL(temperature=temperature)
        out = cross(SimpleNamespace(logits=student), SimpleNamespace(logits=teacher), batch).total
        expected = plain(SimpleNamespace(logits=student), SimpleNamespace(logits=teacher), batch).total
        assert out.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-15)


def test_composes_with_cross_entropy_and_takes_the_map_as_a_model_fact():
    loss = build_loss([{"name": "cross_entropy", "weight": 0.5}, {"name": "cross_tokenizer", "weight": 0.5}],
                      vocab_map=vocab_map())
    assert teacher_token_problems(loss) == []
    assert teacher_token_problems(build_loss([{"name": "cross_entropy", "weight": 1},
                                              {"name": "forward_kl", "weight": 1}])) == ["ForwardKL"]
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(2, 6, VS, generator=generator, dtype=torch.float64)
    teacher = torch.randn(2, 7, VT, generator=generator, dtype=torch.float64)
    out = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=teacher), hand_batch())
    assert out.parts["cross_tokenizer"].item() == pytest.approx(reference(student, teacher, hand_batch(), 1.0, 1.0))
    assert out.total.item() == pytest.approx(0.5 * out.parts["cross_entropy"].item()
                                              + 0.5 * out.parts["cross_tokenizer"].item())


def test_bad_wiring_names_the_fix():
    with pytest.raises(ValueError, match="in a run config set student_tokenizer"):
        CrossTokenizer()
    batch = {k: v for k, v in hand_batch().items() if not k.startswith("align")}
    with pytest.raises(ValueError, match="paired blocks"):
        CrossTokenizer(vocab_map())(SimpleNamespace(logits=torch.zeros(2, 6, VS)),
                                    SimpleNamespace(logits=torch.zeros(2, 7, VT)), batch)


def test_span_divergence_stays_finite_when_the_teacher_is_certain():
    student = torch.tensor([[0.0, 5.0, -3.0]], dtype=torch.float64, requires_grad=True)
    for log_p in (0.0, -1e-20, -50.0):
        value = functional.span_divergence(student, torch.tensor([1]), torch.tensor([log_p], dtype=torch.float64))
        (grad,) = torch.autograd.grad(value.sum(), student)
        assert torch.isfinite(value).all() and torch.isfinite(grad).all()
    a = torch.tensor([-1e-12, -0.1, -0.7, -5.0, -40.0], dtype=torch.float64)
    assert torch.allclose(functional.log1mexp(a), torch.tensor([math.log(-math.expm1(x)) for x in a.tolist()],
                                                               dtype=torch.float64), rtol=1e-12)


def test_a_captured_teacher_is_refused_with_the_reason():
    from losses.sparse import SparseTeacherLogits

    sparse = SparseTeacherLogits(torch.zeros(2, 7, 4), torch.zeros(2, 7, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot train from a captured teacher.*outside the top k"):
        CrossTokenizer(vocab_map())(SimpleNamespace(logits=torch.zeros(2, 6, VS)), SimpleNamespace(logits=sparse),
                                    hand_batch())
