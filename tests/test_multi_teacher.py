"""Several teachers for one student: the mixture math in float64, bad input, and 2 real ranks end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_results
import torch
from launch import ROOT, run_ranks
from tiny_models import gpt2_config
from tolerances import assert_float32_equivalent
from transformers import AutoTokenizer, GPT2LMHeadModel

from distill_kit import Distiller, TeacherSpec
from distill_kit.config import specs
from distill_kit.run.run_config import DEFAULT_TEACHER
from distill_kit.teachers.combine import check_weights
from losses import functional

WORKER = ROOT / "tests/workers/teacher_scenarios.py"


def test_mixture_logits_are_the_weighted_mixture_at_the_temperature():
    generator = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(5, 11, generator=generator, dtype=torch.float64) * 3 for _ in range(3))
    weights, temperature = [0.2, 0.5, 0.3], 2.0
    expected = sum(w * torch.softmax(z / temperature, -1) for w, z in zip(weights, (a, b, c), strict=True))
    got = torch.softmax(functional.mixture_logits([a, b, c], weights, temperature) / temperature, -1)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    # weight 0 leaves a teacher out exactly
    assert torch.equal(functional.mixture_logits([a, b], [1.0, 0.0], 1.0), torch.log_softmax(a, -1))


def test_forward_kl_to_each_teacher_differs_from_kl_to_their_mixture_by_a_constant():
    """sum_k w_k KL(p_k || q) = KL(p_mix || q) + sum_k w_k KL(p_k || p_mix): the gradients in q coincide."""
    generator = torch.Generator().manual_seed(1)
    teachers = [torch.randn(4, 9, generator=generator, dtype=torch.float64) for _ in range(2)]
    student = torch.randn(4, 9, generator=generator, dtype=torch.float64, requires_grad=True)
    weights = [0.3, 0.7]
    mix = functional.mixture_logits(teachers, weights, 1.0)
    summed = sum(w * functional.forward_kl(student, t) for w, t in zip(weights, teachers, strict=True))
    to_mixture = functional.forward_kl(student, mix)
    constant = sum(w * functional._kl(
        torch.log_softmax(t, -1), torch.log_softmax(mix, -1)) for w, t in zip(weights, teachers, strict=True))
    torch.testing.assert_close(summed, to_mixture + constant, rtol=1e-12, atol=1e-12)
    grad_sum, = torch.autograd.grad(summed.sum(), student)
    grad_mix, = torch.autograd.grad(to_mixture.sum(), student)
    torch.testing.assert_close(grad_sum, grad_mix, rtol=1e-10, atol=1e-12)


def test_teacher_entries_are_checked_before_anything_loads():
    def teacher_specs(entries):
        return specs(TeacherSpec, entries, "teacher")

    with pytest.raises(ValueError, match=r"unknown config key 'teachers\[0\].wieght': did you mean "
                                         r"'teachers\[0\].weight'\?"):
        teacher_specs([{"name": "a", "model": "x", "wieght": 1.0}])
    with pytest.raises(ValueError, match=r"every teacher has weight 0"):
        check_weights(teacher_specs([{"name": "a", "model": "x", "weight": 0.0}]))
    with pytest.raises(ValueError, match=r"the names \['a'\] are given more than once"):
        teacher_specs([{"name": "a", "model": "x"}, {"name": "a", "model": "y"}])
    with pytest.raises(ValueError, match=r"weight must be a finite number >= 0"):
        teacher_specs([{"name": "a", "model": "x", "weight": -1.0}])


def test_a_teacher_with_another_tokenizer_is_refused_before_loading(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TEACHER)
    config = gpt2_config(width=32, layers=1, vocab=len(tokenizer) + 8)
    dirs = {}
    for name in ("student", "same", "other"):
        dirs[name] = tmp_path / name
        config.save_pretrained(dirs[name])  # a config is enough: the check runs before any weights load
    tokenizer.save_pretrained(dirs["student"])
    tokenizer.save_pretrained(dirs["same"])
    tokenizer.add_tokens(["<only-in-other>"])
    tokenizer.save_pretrained(dirs["other"])
    with pytest.raises(ValueError, match=r"teachers\[other\]: its tokenizer differs from the run's \('.*': "
                                         r"\d+ tokens; '.*': \d+, or other ids\).*share the student's tokenizer"):
        Distiller(dirs["student"], teachers=[{"name": "same", "model": dirs["same"]},
                                             {"name": "other", "model": dirs["other"]}])


def test_mixture_refuses_hidden_state_losses(tmp_path):
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config(width=32, layers=1)).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"hidden-state and attention losses .* use combine: sum"):
        Distiller(tmp_path / "m", teachers=[{"name": "a", "model": tmp_path / "m"},
                                            {"name": "b", "model": tmp_path / "m"}], loss="hidden_mse",
                  combine="mixture")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out: Path = tmp_path_factory.mktemp("teachers")
    run_ranks(WORKER, [str(out)], nprocs=2, timeout=300)
    return rank_results.read(out, 2)


@pytest.mark.multirank
def test_teachers_weighted_one_and_zero_equal_the_first_teacher_alone(ranks):
    for result in ranks["one_teacher_equivalence"]:
        assert result["sum"] == {"loss_diff": 0.0, "param_diff": 0.0}  # 1 * loss_a + 0 * loss_b: bit for bit
        # the mixture takes log_softmax of a log-softmax again: equal up to float32 rounding (the worker's Adam eps
        # keeps Adam from enlarging rounding-level gradients into full steps)
        assert result["mixture"]["loss_diff"] < 1e-7 and result["mixture"]["param_diff"] < 1e-6


@pytest.mark.multirank
def test_sum_and_mixture_train_the_same_under_forward_kl(ranks):
    """Same gradient (see the float64 test above), so the same weights; the sum's loss is higher by a constant."""
    for result in ranks["one_teacher_equivalence"]:
        half = result["half"]
        assert half["param_change"] > 1e-3 and half["param_diff"] < 1e-6
        assert all(s > m for s, m in zip(half["sum_losses"], half["mixture_losses"], strict=True))
        assert {"a", "b", "loss"} <= set(half["parts"])  # each teacher's term is logged


@pytest.mark.multirank
def test_checkpoints_record_every_teacher_and_refuse_others(ranks):
    for result in ranks["identities"]:
        ids = result["identities"]
        assert ids["a"] != ids["b"]
        assert result["recorded"] == f"a={ids['a']}, b={ids['b']}"
        assert "was trained against teacher sha256 a=" in result["refusal"]
        assert set(result["eval"]) == {"teacher", "student"}


@pytest.mark.multirank
def test_routed_teachers_match_a_plain_loop_of_each_rows_own_teacher(ranks):
    """combine: route on 2 ranks (ZeRO-3 teachers), whole micro-batches of one teacher and then mixed rows with a
    rank that has no row of one teacher, against a plain loop scoring each row by its own teacher."""
    for result in ranks["routed"]:
        assert result["lrs"] == pytest.approx([3e-3, 2e-3, 1e-3], rel=1e-12)
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
        assert result["max_param_change"] > 1e-3
        assert_float32_equivalent(result)  # the bound follows from float32 rounding on this CPU: tests/tolerances.py
        assert set(result["eval"]) == {"teacher", "student"}  # evaluated against each row's own teacher
