"""The registry, model facts, weighted sums, and a user loss plugged in by import path."""

import textwrap
from types import SimpleNamespace

import pytest
import torch

from losses import LOSSES, CrossEntropy, ForwardKL, WeightedSum, build_loss
from losses.base import IGNORE_INDEX


def make_batch(batch=2, seq=5, vocab=7):
    input_ids = torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[:, 0] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def test_unknown_name_lists_every_valid_name_and_a_suggestion():
    with pytest.raises(ValueError, match="Did you mean 'forward_kl'") as err:
        build_loss("forward_kll")
    for name in LOSSES:
        assert name in str(err.value)
    assert "package.module:ClassName" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"temperature": 2.0}, "has no 'name'"),
        ({"name": "forward_kl", "tempreature": 2.0}, "bad parameters for loss 'forward_kl'.*tempreature"),
        ("no_such_module_xyz:Loss", "cannot import loss 'no_such_module_xyz:Loss'"),
        ([{"name": "forward_kl"}], "needs a 'weight'"),
        (["forward_kl"], "needs a 'weight'"),
        ([], "at least one term"),
        ([{"name": "forward_kl", "weight": -1}], "weight must be a finite number >= 0"),
        ([{"name": "forward_kl", "weight": 1}, {"name": "forward_kl", "weight": 1}], "give one of them a distinct"),
        ([{"name": "forward_kl", "weight": 1, "label": "kl-2"}], "must be an identifier"),
    ],
)
def test_config_mistakes_fail_at_build_time_with_the_fix(spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_loss(spec)


def test_non_loss_class_by_path_is_refused():
    with pytest.raises(TypeError, match="subclass of losses.base.DistillationLoss"):
        build_loss("torch.nn:Linear")


def test_weighted_sum_adds_weighted_terms_and_logs_each_unweighted():
    batch = make_batch()
    torch.manual_seed(0)
    student = SimpleNamespace(logits=torch.randn(2, 5, 7, requires_grad=True))
    teacher = SimpleNamespace(logits=torch.randn(2, 5, 7))
    loss = build_loss(
        [
            {"name": "cross_entropy", "weight": 0.3},
            {"name": "forward_kl", "weight": 0.7, "temperature": 2.0},
            {"name": "forward_kl", "weight": 0.5, "label": "kl_t1"},
        ]
    )
    assert isinstance(loss, WeightedSum)
    out = loss(student, teacher, batch)
    ce = CrossEntropy()(student, teacher, batch).total
    kl2 = ForwardKL(temperature=2.0)(student, teacher, batch).total
    kl1 = ForwardKL()(student, teacher, batch).total
    torch.testing.assert_close(out.total, 0.3 * ce + 0.7 * kl2 + 0.5 * kl1)
    assert set(out.parts) == {"cross_entropy", "forward_kl", "kl_t1"}
    torch.testing.assert_close(out.parts["forward_kl"], kl2.detach())
    assert all(not part.requires_grad for part in out.parts.values())
    out.total.backward()
    assert student.logits.grad is not None


def test_weighted_sum_propagates_needs_and_owns_the_projection():
    facts = {"student_hidden_size": 4, "teacher_hidden_size": 6, "student_num_layers": 2, "teacher_num_layers": 4}
    loss = build_loss(
        [{"name": "forward_kl", "weight": 1.0}, {"name": "hidden_mse", "weight": 0.1}],
        **facts,
    )
    assert loss.needs_hidden_states and not loss.needs_attentions
    assert set(loss.state_dict()) == {"terms.hidden_mse.projection.weight", "terms.hidden_mse.projection.bias"}
    assert loss.terms["hidden_mse"].layers == [(1, 2), (2, 4)]
    assert build_loss([{"name": "attention_kl", "weight": 1.0}], **facts).needs_attentions


def test_model_facts_reach_only_losses_that_take_them_and_config_wins():
    facts = {"student_hidden_size": 4, "teacher_hidden_size": 6, "student_num_layers": 2, "teacher_num_layers": 4}
    assert isinstance(build_loss("forward_kl", **facts), ForwardKL)  # takes none of them: no TypeError
    explicit = build_loss({"name": "hidden_cosine", "layers": [[2, 1]]}, **facts)
    assert explicit.layers == [(2, 1)]


USER_LOSS = '''
    import torch
    from losses import DistillationLoss, LossOutput
    from losses.base import normalizer, valid_positions


    class SquaredProbGap(DistillationLoss):
        """sum_v (p - q)^2 per token: a user loss that also asks for a model fact by naming it."""

        def __init__(self, scale=1.0, student_num_layers=None):
            super().__init__()
            self.scale, self.student_num_layers = scale, student_num_layers

        def forward(self, student, teacher, batch):
            mask = valid_positions(batch)
            gap = (student.logits.softmax(-1) - teacher.logits.softmax(-1)).square().sum(-1)
            loss = self.scale * gap[mask].sum() / normalizer(batch, mask)
            return LossOutput(loss, {"gap": loss.detach()})
'''


def test_user_loss_by_import_path_trains_a_student(tmp_path, monkeypatch):
    (tmp_path / "my_user_losses.py").write_text(textwrap.dedent(USER_LOSS))
    monkeypatch.syspath_prepend(str(tmp_path))
    loss = build_loss(
        [
            {"name": "my_user_losses:SquaredProbGap", "weight": 1.0, "scale": 10.0},
            {"name": "forward_kl", "weight": 0.1},
        ],
        student_num_layers=3,
    )
    user = loss.terms["SquaredProbGap"]
    assert (user.scale, user.student_num_layers) == (10.0, 3)

    torch.manual_seed(0)
    batch = make_batch()
    student, teacher = torch.nn.Embedding(7, 7), torch.nn.Embedding(7, 7)
    optimizer = torch.optim.SGD(student.parameters(), lr=1.0)
    values = []
    for _ in range(20):
        out = loss(
            SimpleNamespace(logits=student(batch["input_ids"])),
            SimpleNamespace(logits=teacher(batch["input_ids"]).detach()),
            batch,
        )
        optimizer.zero_grad()
        out.total.backward()
        optimizer.step()
        values.append(out.parts["SquaredProbGap"].item())
    assert values[-1] < 0.5 * values[0]
