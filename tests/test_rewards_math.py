"""The parts of an objective with rewards against float64 references written out here, element by element, and the
reward library's refusals (no engine: the fast tier)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from distill_kit.config import RewardsConfig, RewardSpec, TrainingConfig, build
from distill_kit.errors import ConfigError, RewardFailed
from distill_kit.rewards import register, resolve
from distill_kit.tasks import arithmetic
from distill_kit.training.rewarding import Rewarder
from losses import build_loss
from losses.functional import clipped_surrogate, group_advantages
from losses.fused import HeadOutput


def reference_group_advantages(rewards: list[float], size: int, scale: bool, eps: float = 1e-4) -> list[float]:
    """GRPO's advantage, one group at a time in plain Python floats (Bessel-corrected std)."""
    out = []
    for start in range(0, len(rewards), size):
        group = rewards[start:start + size]
        mean = sum(group) / size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (size - 1))
        out += [(r - mean) / (std + eps) if scale else r - mean for r in group]
    return out


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_the_definition(scale):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.0]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), 4, scale).tolist()
    assert got == pytest.approx(reference_group_advantages(rewards, 4, scale), abs=1e-12)  # float64 throughout
    assert got[4:8] == [0.0] * 4  # a group of equal rewards: no signal


def test_clipped_surrogate_matches_ppo_per_token_with_its_gradient():
    """Values and gradients of the surrogate against PPO's formula, token by token in float64: ratios inside and
    outside the clip range, positive and negative advantages."""
    generator = torch.Generator().manual_seed(0)
    log_p = torch.randn(64, dtype=torch.float64, generator=generator).mul(0.3).requires_grad_(True)
    old = log_p.detach() + torch.randn(64, dtype=torch.float64, generator=generator).mul(0.4)
    adv = torch.randn(64, dtype=torch.float64, generator=generator)
    loss = clipped_surrogate(log_p, old, adv, 0.2, 0.28)
    loss.sum().backward()
    for i in range(64):
        ratio = math.exp(log_p[i].item() - old[i].item())
        clipped = min(max(ratio, 0.8), 1.28)
        a = adv[i].item()
        assert loss[i].item() == pytest.approx(-min(ratio * a, clipped * a), rel=1e-12)
        # d/dlogp of -min(rA, clip(r)A): -rA where the unclipped term is the smaller (or the clip is not binding)
        active = ratio * a <= clipped * a
        assert log_p.grad[i].item() == pytest.approx(-ratio * a if active else 0.0, rel=1e-12, abs=1e-15)
    assert (loss != 0).any() and (log_p.grad == 0).any()  # both regimes were exercised


def test_fresh_samples_give_reinforce():
    """Without sampling-time log-probabilities the ratio is 1: the loss is -A and its gradient -A, exactly."""
    log_p = torch.randn(16, dtype=torch.float64).requires_grad_(True)
    adv = torch.randn(16, dtype=torch.float64)
    loss = clipped_surrogate(log_p, None, adv, 0.2, 0.2)
    loss.sum().backward()
    assert torch.equal(loss.detach(), -adv) and torch.equal(log_p.grad, -adv)


def _rows(seed: int = 0, rows: int = 3, length: int = 6, vocab: int = 11):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, length, vocab, dtype=torch.float64, generator=generator).requires_grad_(True)
    teacher = torch.randn(rows, length, vocab + 2, dtype=torch.float64, generator=generator)  # padded vocabulary
    labels = torch.randint(0, vocab, (rows, length), generator=generator)
    labels[:, :2] = -100  # the prompt
    labels[1, 4:] = -100  # a short sample
    advantages = torch.randn(rows, dtype=torch.float64, generator=generator)
    return student, teacher, labels, advantages


def reference_policy_loss(student, teacher, labels, advantages, teacher_w, reward_w, fixed, level):
    """The objective written out token by token: A_t = w_T (log p_T - log p_S) + w_R A_row + fixed at each sampled
    token (position t predicts label t + 1), the surrogate -A r with r = p / p held constant (value -A, gradient
    REINFORCE's -A grad log p), then the token or sequence average."""
    total, tokens, sequences = 0.0, 0, 0
    log_s = F.log_softmax(student, -1)
    log_t = F.log_softmax(teacher[..., :student.shape[-1]], -1)
    for b in range(student.shape[0]):
        row, count = 0.0, 0
        for t in range(student.shape[1] - 1):
            label = labels[b, t + 1].item()
            if label == -100:
                continue
            a = teacher_w * (log_t[b, t, label] - log_s[b, t, label]).item() + reward_w * advantages[b].item() + fixed
            row = row - a * torch.exp(log_s[b, t, label] - log_s[b, t, label].detach())
            count += 1
        if count:
            total = total + (row / count if level == "sequence" else row)
            tokens, sequences = tokens + count, sequences + 1
    return total / (sequences if level == "sequence" else tokens)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("weights", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.7, 1.3, 0.0), (0.0, 0.0, -1.0)])
def test_policy_gradient_loss_matches_the_objective_written_out(level, weights):
    """Value and gradient of ``policy_gradient`` (chunked, 2 rows a chunk) against the float64 reference: every part
    weighted, at both averaging levels."""
    student, teacher, labels, advantages = _rows()
    teacher_w, reward_w, fixed = weights
    loss = build_loss({"name": "policy_gradient", "teacher": teacher_w, "reward": reward_w, "fixed": fixed,
                       "level": level, "chunk_size": 2})
    batch = {"input_ids": labels.clamp(min=0), "labels": labels, "advantages": advantages}
    out = loss(type("Out", (), {"logits": student})(), type("Out", (), {"logits": teacher})(), batch)
    out.total.backward()
    got = student.grad.clone()
    student.grad = None
    expected = reference_policy_loss(student, teacher, labels, advantages, teacher_w, reward_w, fixed, level)
    expected.backward()
    assert out.total.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    assert torch.allclose(got, student.grad, rtol=1e-10, atol=1e-12)
    assert ("teacher_advantage" in out.parts) == (teacher_w != 0)


def test_policy_gradient_takes_the_teachers_head_at_the_loss():
    """A teacher's hidden states and head (``HeadOutput``) give the loss and gradient its logits give."""
    student, _, labels, advantages = _rows(1)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 6, 5, dtype=torch.float64, generator=generator)
    head = torch.nn.Linear(5, 13, bias=False, dtype=torch.float64)
    loss = build_loss({"name": "policy_gradient", "teacher": 1.0, "reward": 0.5, "chunk_size": 4})
    batch = {"input_ids": labels.clamp(min=0), "labels": labels, "advantages": advantages}
    values = []
    for teacher in (HeadOutput(hidden, head), type("Out", (), {"logits": head(hidden).detach()})()):
        out = loss(type("Out", (), {"logits": student})(), teacher, batch)
        out.total.backward()
        values.append((out.total.item(), student.grad.clone(), out.parts["teacher_advantage"].item()))
        student.grad = None
    assert values[0][0] == pytest.approx(values[1][0], rel=1e-12)
    assert torch.allclose(values[0][1], values[1][1], rtol=1e-12, atol=1e-15)
    assert values[0][2] == pytest.approx(values[1][2], rel=1e-12)


def test_policy_gradient_refuses_bad_settings():
    with pytest.raises(ValueError, match="weights are >= 0"):
        build_loss({"name": "policy_gradient", "teacher": -1.0})
    with pytest.raises(ValueError, match="level"):
        build_loss({"name": "policy_gradient", "level": "batch"})
    with pytest.raises(ValueError, match="finite"):
        build_loss({"name": "policy_gradient", "fixed": float("nan")})
    student, teacher, labels, _ = _rows()
    with pytest.raises(ValueError, match="training.rewards"):
        build_loss({"name": "policy_gradient", "reward": 1.0})(
            type("Out", (), {"logits": student})(), type("Out", (), {"logits": teacher})(), {"labels": labels,
                                                                                             "input_ids": labels})


# ---- the reward library -------------------------------------------------------------------------------------

@register("digit_ones")
def digit_ones(prompt: str, completion: str) -> float:
    return float(completion.count("1"))


def needs_answer(prompt: str, completion: str, *, answer: str) -> float:
    return float(completion == answer)


def one_argument(completion):
    return 1.0


def test_shipped_checkers_are_rewards():
    item = next(arithmetic.examples(0, 1))
    reward = resolve("arithmetic", "k")
    assert reward(item.prompt, item.answer, [], []) == 1.0
    assert reward(item.prompt, item.answer + "1", [], []) == 0.0
    assert resolve("sorting", "k")("52819374", "12345789", [], []) == 1.0


def test_reward_refusals_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"k: unknown reward 'arithmetik'.*Did you mean 'arithmetic'"):
        resolve("arithmetik", "k")
    with pytest.raises(ConfigError, match="cannot import reward 'no_such_module:f'.*PYTHONPATH"):
        resolve("no_such_module:f", "k")
    with pytest.raises(ConfigError, match=r"takes \(completion\); a reward takes \(prompt, completion\)"):
        resolve(f"{__name__}:one_argument", "k")
    with pytest.raises(ConfigError, match=r"record field\(s\) \['answer'\].*they have \['prompt'\]"):
        resolve(f"{__name__}:needs_answer", "k", fields=["prompt"])
    assert resolve(f"{__name__}:needs_answer", "k", fields=["prompt", "answer"]).fields == ("answer",)


@pytest.mark.parametrize("returned", [float("nan"), float("inf"), "1.0", [1.0], None])
def test_a_reward_that_returns_no_finite_number_is_named(returned):
    register("bad_reward")(lambda prompt, completion: returned)
    with pytest.raises(ValueError, match="reward 'bad_reward' returned"):
        resolve("bad_reward", "k")("p", "c", [], [])


def test_rewards_settings_are_checked_when_built():
    with pytest.raises(ConfigError, match="samples_per_prompt"):
        build(TrainingConfig, {"micro_batch_size": 6, "on_policy": {"fraction": 1.0, "samples_per_prompt": 4}})
    with pytest.raises(ConfigError, match="score the student's own samples"):
        build(TrainingConfig, {"rewards": {"functions": [{"name": "arithmetic"}]}})
    with pytest.raises(ConfigError, match="fraction: 1.0"):
        build(TrainingConfig, {"micro_batch_size": 8, "on_policy": {"fraction": 0.5, "samples_per_prompt": 2}})


def test_rewarder_scores_each_sample_and_normalises_each_group():
    """Rows of two groups of two: the prompts and samples decoded by the task's tokenizer, each group's advantages
    and no-signal flags as defined; a reward that raises stops with the prompt named."""
    tokenizer = arithmetic.build_tokenizer()
    items = list(arithmetic.examples(3, 2))
    answers = [items[0].answer, "1#1", "11", "11"]
    rows = [arithmetic.encode(tokenizer, arithmetic.Example(items[i // 2].prompt, a, 0)) for i, a in enumerate(answers)]
    width = max(len(ids) for ids, _ in rows)
    batch = {"input_ids": torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows]),
             "labels": torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rows]),
             "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])}
    config = RewardsConfig(functions=(RewardSpec(name="arithmetic"), RewardSpec(name="digit_ones", weight=0.5)))
    rewarder = Rewarder(config, [resolve(s.name, "k") for s in config.functions], tokenizer, group_size=2)
    out = rewarder(batch)
    expected = [1.0 + 0.5 * answers[0].count("1"), 0.5 * 2, 0.5 * 2, 0.5 * 2]
    assert out["rewards"].tolist() == pytest.approx(expected)
    assert out["advantages"].tolist() == pytest.approx(reference_group_advantages(expected, 2, True), abs=1e-6)
    assert out["no_signal"].tolist() == [expected[0] == expected[1]] * 2 + [True, True]

    @register("broken")
    def broken(prompt, completion):
        raise KeyError("boom")
    failing = Rewarder(RewardsConfig(functions=(RewardSpec(name="broken"),)), [resolve("broken", "k")], tokenizer,
                       group_size=2)
    with pytest.raises(RewardFailed, match=rf"reward 'broken' failed on the prompt '{re.escape(items[0].prompt)}' "
                                           r"\(row 0\).*KeyError.*--resume"):
        failing(batch)


def test_the_report_says_per_seed_whether_the_teacher_helped():
    from distill_kit.run.task_benchmark import teacher_helps

    def seed(**accuracy):
        return {"rows": [{"recipe": name, "exact_match": value} for name, value in accuracy.items()]}
    per_seed = [seed(opd=0.5, fixed_advantage=0.1, grpo=0.2, opd_reward=0.6),
                seed(opd=0.3, fixed_advantage=0.3, grpo=0.4, opd_reward=0.4),   # a tie with the control: no
                seed(opd=0.7, fixed_advantage=0.0, grpo=0.1, opd_reward=0.65)]
    verdicts = teacher_helps(per_seed)
    assert verdicts["opd_over_fixed_advantage"] == {"per_seed": [True, False, True], "all": False}
    assert verdicts["opd_reward_over_best_of_opd_grpo"] == {"per_seed": [True, True, False], "all": False}
    assert teacher_helps([seed(opd=0.5, grpo=0.1)]) is None  # the recipes to compare did not all run
