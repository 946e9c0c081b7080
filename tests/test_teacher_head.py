"""The teacher's head applied at the loss (a teacher ``HeadOutput``: final hidden states and head, no logits) against
the dense teacher (its full logits): same values and gradients w.r.t. the student's hidden states, head weight and
bias, with the fused student and the materialised one, in float64 and in float32; under the compiled per-chunk step,
no recompile from a new head tensor each step; and ``engines/head.py``'s teacher side on real tiny models,
replicated here and under ZeRO-3 in a one-rank worker."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from spies import linear_rows
from test_losses import make_batch
from tiny_models import gpt2_config, qwen2_config
from tolerances import SPREAD
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

import losses.fused as fused
from distill_kit.config import TeacherSpec, TrainingConfig
from distill_kit.engines.head import teacher_head_forward
from distill_kit.teachers import HEAD
from distill_kit.teachers.engine import EngineTeacher
from distill_kit.training.plan import why_not_head_at_loss
from losses import DistillationLoss, LossOutput, WeightedSum, build_loss
from losses.fused import HeadOutput

BATCH, SEQ, HIDDEN, TEACHER_HIDDEN, VOCAB, PADDED = 3, 7, 6, 10, 11, 3
SPECS = {  # every kind of per-token divergence, and a temperature of 1 beside the others' 2
    "forward_kl": {"name": "forward_kl", "temperature": 2.0},
    "reverse_kl": {"name": "reverse_kl", "temperature": 2.0},
    "generalized_jsd": {"name": "generalized_jsd", "beta": 0.3, "temperature": 2.0},
    "forward_kl_t1": {"name": "forward_kl", "temperature": 1.0},
}


def models(dtype: torch.dtype) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.Tensor]:
    """A student head (V, H), a teacher head whose vocabulary is padded past the student's, teacher hidden states.

    Made in float64 and cast, so that a float32 run and its float64 reference see the same numbers. The padded
    rows' bias makes them the teacher's most likely tokens: a path that failed to cut them changes every loss.
    """
    torch.manual_seed(0)
    student = torch.nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)
    student.weight.data.mul_(3.0)
    teacher = torch.nn.Linear(TEACHER_HIDDEN, VOCAB + PADDED, dtype=torch.float64)
    teacher.weight.data.mul_(3.0)
    teacher.bias.data[VOCAB:] = 50.0
    teacher_hidden = torch.randn(BATCH, SEQ, TEACHER_HIDDEN, dtype=torch.float64)
    return student.to(dtype), teacher.to(dtype), teacher_hidden.to(dtype)


def run(spec: dict, dtype: torch.dtype, student_fused: bool, teacher_headless: bool,
        grad: bool = True) -> list[torch.Tensor]:
    """(loss, grads of the student's hidden states, head weight and bias) for one pairing of the two paths."""
    student_head, teacher_head, teacher_hidden = models(dtype)
    torch.manual_seed(1)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64).to(dtype).requires_grad_(grad)
    student = HeadOutput(hidden, student_head) if student_fused else SimpleNamespace(logits=student_head(hidden))
    with torch.no_grad():
        teacher = (HeadOutput(teacher_hidden, teacher_head) if teacher_headless else
                   SimpleNamespace(logits=teacher_head(teacher_hidden)))
    batch = make_batch(BATCH, SEQ, VOCAB) | {"loss_normalizer": torch.tensor(5.0, dtype=dtype)}
    value = build_loss(spec | {"chunk_size": 4})(student, teacher, batch).total
    if teacher_headless:
        assert teacher._logits is None  # the loss applied the head per chunk; the full logits were never built
    if not grad:
        return [value]
    value.backward()
    return [value.detach(), hidden.grad, student_head.weight.grad, student_head.bias.grad]


@pytest.mark.parametrize("student_fused", [True, False], ids=["fused_student", "materialised_student"])
@pytest.mark.parametrize("name", SPECS)
def test_headless_teacher_equals_dense_teacher_in_float64(name, student_fused):
    """The two paths differ only in the order of the teacher matmul's float64 roundings (per chunk of rows against
    all rows at once): each logit's dot product of 10 terms carries at most ~10 u = 1e-15 of its size (u = 2^-53),
    and the divergences' values and gradients move by a small multiple of that. The tolerance is far above such
    rounding and far below any real difference (a wrong cut, temperature or row changes values by over 1e-3)."""
    headless = run(SPECS[name], torch.float64, student_fused, teacher_headless=True)
    dense = run(SPECS[name], torch.float64, student_fused, teacher_headless=False)
    assert all(t.abs().max() > 0 for t in dense)  # the comparison is not of zeros
    for a, b in zip(headless, dense, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("student_fused", [True, False], ids=["fused_student", "materialised_student"])
@pytest.mark.parametrize("name", ["forward_kl", "generalized_jsd"])
def test_headless_teacher_equals_dense_teacher_in_float32(name, student_fused):
    """The bound is float32 rounding's own size on this problem, measured, as ``tests/tolerances.py`` derives it.

    Both float32 runs compute the float64 reference's function with float32 roundings added, in different orders
    (the teacher's logits per chunk of rows, or all at once), on the same float32 inputs. ``rounding`` is how far
    the dense float32 run lands from the float64 run of those inputs, per output: float32 rounding's size here.
    The headless run is another draw of the same rounding process, so it lands within ``SPREAD`` times that of
    float64, and (triangle inequality) within ``(1 + SPREAD)`` times that of the dense float32 run. A real
    difference (a padded row left in, a wrong temperature) is of the size of the outputs themselves.
    """
    reference = run(SPECS[name], torch.float64, student_fused, teacher_headless=False)  # float32's inputs, exactly
    headless = run(SPECS[name], torch.float32, student_fused, teacher_headless=True)
    dense = run(SPECS[name], torch.float32, student_fused, teacher_headless=False)
    for ours, theirs, exact in zip(headless, dense, reference, strict=True):
        rounding = (theirs.double() - exact).abs().max().item()
        assert 0 < rounding < 1e-4 * exact.abs().max().item()  # float32 rounding, small next to the outputs
        assert (ours.double() - exact).abs().max().item() <= SPREAD * rounding
        assert (ours - theirs).abs().max().item() <= (1 + SPREAD) * rounding


@pytest.mark.parametrize("student_fused", [True, False], ids=["fused_student", "materialised_student"])
def test_no_grad_evaluation_matches(student_fused):
    with torch.no_grad():
        headless = run(SPECS["reverse_kl"], torch.float64, student_fused, teacher_headless=True, grad=False)
        dense = run(SPECS["reverse_kl"], torch.float64, student_fused, teacher_headless=False, grad=False)
    assert not headless[0].requires_grad
    torch.testing.assert_close(headless[0], dense[0], rtol=1e-12, atol=1e-12)


def test_no_full_teacher_logits_and_the_head_reaches_the_step_as_an_input():
    """Every matmul of the headless teacher and the fused student makes one chunk of rows; the teacher's head
    weight and bias are the chunk loss's shared tensors, passed to the per-chunk step as arguments."""
    n_tokens, chunk = 32, 4
    batch = {"input_ids": torch.zeros(1, n_tokens, dtype=torch.long), "attention_mask": torch.ones(1, n_tokens)}
    batch["labels"] = batch["input_ids"]
    student_head, teacher_head = torch.nn.Linear(HIDDEN, VOCAB), torch.nn.Linear(TEACHER_HIDDEN, VOCAB)
    student = HeadOutput(torch.randn(1, n_tokens, HIDDEN, requires_grad=True), student_head)
    teacher = HeadOutput(torch.randn(1, n_tokens, TEACHER_HIDDEN), teacher_head)
    loss = build_loss({"name": "forward_kl", "chunk_size": chunk})
    chunk_loss = loss.chunk_loss(loss.teacher_targets(teacher), batch["labels"].reshape(-1))
    assert [t.data_ptr() for t in chunk_loss.shared] == [teacher_head.weight.data_ptr(), teacher_head.bias.data_ptr()]
    assert not any(t.requires_grad for t in chunk_loss.shared + chunk_loss.targets)  # the teacher is not trained
    with linear_rows() as created:
        loss(student, teacher, batch).total.backward()
    assert len(created) == 2 * n_tokens // chunk  # a student chunk and a teacher chunk, per chunk
    assert max(created) <= chunk and teacher._logits is None


def test_compiled_step_does_not_recompile_for_a_new_teacher_head_each_step(monkeypatch):
    """The CUDA path's ``torch.compile``d step, on the CPU with a counting backend (the guards are dynamo's, the
    backend only runs the graph): a ZeRO-3 teacher hands a freshly gathered head every step, which must not
    compile anything after the first step. The first compiles once per chunk length (the last chunk is shorter:
    a dynamic length), which the second step then reuses."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    monkeypatch.setattr(fused, "_compiled", lambda: torch.compile(fused.value_and_grad, backend=counter))
    torch._dynamo.reset()
    batch = make_batch(BATCH, SEQ, VOCAB)
    rows = batch["labels"][:, 1:].ne(-100).nonzero()  # counted positions, as the loss selects them
    rows = rows[:, 0] * SEQ + rows[:, 1]
    loss = build_loss({"name": "generalized_jsd", "beta": 0.3, "temperature": 2.0})
    frames = []
    for step in range(3):
        torch.manual_seed(step)
        hidden = torch.randn(BATCH * SEQ, HIDDEN, requires_grad=True)
        weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
        teacher = HeadOutput(torch.randn(BATCH, SEQ, TEACHER_HIDDEN), torch.nn.Linear(TEACHER_HIDDEN, VOCAB + PADDED))
        chunk_loss = loss.chunk_loss(loss.teacher_targets(teacher), batch["labels"].reshape(-1))
        values = []
        for compile in (True, False):
            value = fused.fused_head_loss(hidden, weight, None, rows, chunk_loss, 4, compile=compile)
            values.append([value, *torch.autograd.grad(value, (hidden, weight))])
        for a, b in zip(*values, strict=True):
            torch.testing.assert_close(a, b)
        frames.append(counter.frame_count)
    assert rows.numel() % 4 and frames[0] >= 1 and frames[1] == frames[2], frames


def test_which_losses_take_the_teacher_head():
    """Logit losses apply it; losses of hidden states, attentions or labels never read the teacher's logits; a user
    ``DistillationLoss`` is assumed to read them, and a weighted sum takes it only when every term does."""
    for spec in ("forward_kl", "reverse_kl", "generalized_jsd", "logit_mse", "cross_entropy", "mutual_kl",
                 "tests.user_losses:HalfForwardKL", {"name": "hidden_mse", "layers": [[1, 1]]},
                 {"name": "attention_kl", "layers": [[0, 0]]}):
        assert build_loss(spec).takes_teacher_head, spec
    assert not LogitsNorm().takes_teacher_head
    both = build_loss([{"name": "cross_entropy", "weight": 0.5}, {"name": "forward_kl", "weight": 1.0}])
    assert both.takes_teacher_head
    assert not WeightedSum([("kl", 1.0, build_loss("forward_kl")), ("norm", 1.0, LogitsNorm())]).takes_teacher_head


class LogitsNorm(DistillationLoss):
    """A user loss on the teacher's full logits: it gets them from a ``HeadOutput``, built on first read."""

    def forward(self, student, teacher, batch):
        value = teacher.logits.square().mean()
        return LossOutput(value, {"norm": value.detach()})


def test_a_loss_that_reads_teacher_logits_gets_them_and_a_logit_loss_reuses_them():
    _, teacher_head, teacher_hidden = models(torch.float64)
    teacher = HeadOutput(teacher_hidden, teacher_head)
    norm = LogitsNorm()(SimpleNamespace(), teacher, {}).total
    torch.testing.assert_close(norm, teacher_head(teacher_hidden).square().mean())
    built = teacher._logits
    assert built is not None
    loss = build_loss({"name": "forward_kl"})
    assert loss.teacher_targets(teacher) is built  # built once already: the loss reads them, applies no head
    student = SimpleNamespace(logits=torch.randn(BATCH, SEQ, VOCAB, dtype=torch.float64))
    batch = make_batch(BATCH, SEQ, VOCAB)
    torch.testing.assert_close(loss(student, teacher, batch).total,
                               loss(student, SimpleNamespace(logits=teacher_head(teacher_hidden)), batch).total)


def test_the_plan_says_why_a_teacher_keeps_its_head():
    """The plan's rule (``plan.why_not_head_at_loss``), read from the teacher's card: no model is loaded."""
    card = EngineTeacher.describe(TeacherSpec(name="t", model=GPT2LMHeadModel(gpt2_config(width=16, layers=1))))
    on, off = TrainingConfig(), TrainingConfig(teacher_head_at_loss=False)
    kl = build_loss("forward_kl")
    assert why_not_head_at_loss(card, [kl], on, "sum") is None
    assert why_not_head_at_loss(card, [kl, build_loss("cross_entropy")], on, "sum") is None
    assert "training.teacher_head_at_loss is off" in why_not_head_at_loss(card, [kl], off, "sum")
    assert "LogitsNorm" in why_not_head_at_loss(card, [kl, LogitsNorm()], on, "sum")
    mixed = WeightedSum([("kl", 1.0, kl), ("norm", 1.0, LogitsNorm())])
    assert "WeightedSum" in why_not_head_at_loss(card, [mixed], on, "sum")
    assert "combine: mixture" in why_not_head_at_loss(card, [kl], on, "mixture")
    gemma = dataclasses.replace(card, outputs=card.outputs - {HEAD}, model_type="gemma2")  # soft-caps after the head
    assert "known to apply exactly only for model types" in why_not_head_at_loss(gemma, [kl], on, "sum")


@pytest.mark.parametrize("make", [lambda: GPT2LMHeadModel(gpt2_config(width=16, layers=2)),
                                  lambda: AutoModelForCausalLM.from_config(qwen2_config())],
                         ids=["gpt2_tied", "qwen2"])
def test_teacher_head_forward_of_a_replicated_teacher_equals_its_logits(make):
    torch.manual_seed(3)
    model = make().double().eval()
    batch = make_batch(BATCH, SEQ, VOCAB)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "output_hidden_states": True}
    with torch.no_grad():
        headless = teacher_head_forward(model, **inputs)
        whole = model(**inputs)
    assert headless.head is model.get_output_embeddings()  # its own head, no copy
    for a, b in zip(headless.hidden_states, whole.hidden_states, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    student = SimpleNamespace(logits=torch.randn(*whole.logits.shape, dtype=torch.float64))
    loss = build_loss({"name": "forward_kl", "temperature": 2.0, "chunk_size": 5})
    torch.testing.assert_close(loss(student, headless, batch).total, loss(student, whole, batch).total,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(headless.logits, whole.logits, rtol=1e-12, atol=1e-12)


def test_teacher_head_forward_gathers_a_zero3_head_once(tmp_path):
    """One CPU rank, a real ZeRO-3 engine (persistence threshold 0, so even a tiny head is partitioned): the copy
    handed on is exactly the full weight, the head is partitioned again after the call, and the headless loss, the
    lazily built logits and a whole forward between headless ones equal the unpartitioned model's."""
    from launch import ROOT, run_ranks

    run_ranks(ROOT / "tests/workers/teacher_head_scenarios.py", [str(tmp_path)], nprocs=0, timeout=300)
    result = json.loads((tmp_path / "teacher_head.rank0.json").read_text())
    for name, scenario in result.items():
        assert scenario["partitioned_before"] and scenario["partitioned_after"], name
        assert scenario["gathered_head"] and scenario["trace_complete"], name
        assert scenario["max_diff_weight"] == 0.0, name  # a copy of the gathered weight, bit for bit
        # One rank runs the same float32 kernels on the same weights, partitioned or not.
        for key in ("hidden", "logits", "full_forward"):
            assert scenario[f"max_diff_{key}"] == 0.0, (name, key)
        assert scenario["max_diff_loss"] < 1e-6, name  # relative; per-chunk float32 sums against whole rows
