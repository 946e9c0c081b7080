"""Speculative decoding (``distill_kit/training/speculative.py``) against its definition.

Greedy: the output is the target's greedy output. Sampled: the output distribution is the target's, computed
exactly by enumerating every branch of the procedure's random draws (a categorical draw, a coin) on two bigram
models of a 3-token vocabulary. A drafter identical to its target keeps every draft (tau = gamma + 1), and one draft
is kept with probability 1 - TV(p, q), the identity that makes total variation the drafter's objective.
"""

from __future__ import annotations

import copy
import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import GPT2LMHeadModel

import losses.functional as functional
from distill_kit.training import speculative
from tests.tiny_models import gpt2_config

EOS = 0


@pytest.fixture(scope="module")
def gpt2_pair():
    torch.manual_seed(7)
    target = GPT2LMHeadModel(gpt2_config(width=32, layers=2)).eval()
    drafter = GPT2LMHeadModel(gpt2_config(width=16, layers=1)).eval()
    return target, drafter


def prompts(count: int, length: int = 6) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, 96, (length,), generator=generator) for _ in range(count)]


def test_greedy_returns_the_targets_greedy_tokens(gpt2_pair):
    target, drafter = gpt2_pair
    for prompt in prompts(3):
        expected = target.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
                                   max_new_tokens=20, eos_token_id=EOS, pad_token_id=EOS)[0, len(prompt):]
        for gamma in (1, 3):
            decoded = speculative.speculative_decode(target, drafter, prompt, gamma=gamma, max_new_tokens=20,
                                                     eos_token_id=EOS)
            assert decoded.tokens.tolist() == expected.tolist()
            assert all(0 <= a <= gamma for a in decoded.accepted)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_drafter_identical_to_the_target_has_tau_gamma_plus_one(gpt2_pair, mode):
    target, _ = gpt2_pair
    gamma = 4
    accepted = []
    for prompt in prompts(2):  # sampled: p / q is exactly 1 at every draft, so no coin is even drawn
        accepted += speculative.speculative_decode(target, target, prompt, gamma=gamma, max_new_tokens=12,
                                                   mode=mode).accepted
    figures = speculative.acceptance_figures(accepted, gamma)
    assert figures["tau"] == gamma + 1
    assert figures["acceptance_by_position"] == [1.0] * gamma


def test_acceptance_figures_follow_their_definition():
    figures = speculative.acceptance_figures([0, 2, 4], gamma=4)
    assert figures["tau"] == (0 + 2 + 4 + 3) / 3  # each round adds the target's own token to its kept drafts
    # position i: rounds whose drafts before i were all kept (reached), and of them those that kept draft i
    assert figures["acceptance_by_position"] == [2 / 3, 2 / 2, 1 / 2, 1 / 1]


class Bigram(nn.Module):
    """Next-token logits from the last token alone: a model whose distributions a test writes down."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table, self.config = table, SimpleNamespace(vocab_size=table.shape[-1])

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[input_ids])


class Enumerated:
    """Randomness that follows a scripted path of choices, then the first option of each new one, and keeps the
    probability of the path it took: running every path, in odometer order, enumerates the procedure's outcomes."""

    def __init__(self, path: list[int]):
        self.path, self.taken, self.probability = path, [], 1.0

    def _choose(self, options: list[tuple[object, float]]) -> object:
        options = [(value, p) for value, p in options if p > 0]
        k = self.path[len(self.taken)] if len(self.taken) < len(self.path) else 0
        self.taken.append((k, len(options)))
        self.probability *= options[k][1]
        return options[k][0]

    def categorical(self, probs):
        return self._choose([(i, float(p)) for i, p in enumerate(probs.double().tolist())])

    def bernoulli(self, prob):
        return self._choose([(True, prob), (False, 1.0 - prob)])


def exact_distribution(run) -> dict:
    """{outcome: probability} of ``run(randomness)`` over every path of its draws."""
    distribution, path = defaultdict(float), []
    while True:
        rng = Enumerated(path)
        distribution[run(rng)] += rng.probability
        taken = rng.taken
        while taken and taken[-1][0] + 1 == taken[-1][1]:
            taken.pop()
        if not taken:
            return distribution
        path = [k for k, _ in taken[:-1]] + [taken[-1][0] + 1]


@pytest.fixture(scope="module")
def bigrams():
    generator = torch.Generator().manual_seed(11)
    target = Bigram(torch.randn(3, 3, generator=generator, dtype=torch.float64) * 1.5)
    drafter = Bigram(torch.randn(3, 3, generator=generator, dtype=torch.float64) * 1.5)
    return target, drafter


@pytest.mark.parametrize("gamma", [1, 2])
def test_sampled_output_distribution_is_the_targets(bigrams, gamma):
    target, drafter = bigrams
    prompt, length, temperature = torch.tensor([1]), 2, 0.8
    found = exact_distribution(lambda rng: tuple(speculative.speculative_decode(
        target, drafter, prompt, gamma=gamma, max_new_tokens=length, mode="sampled", temperature=temperature,
        rng=rng).tokens.tolist()))
    p = torch.softmax(target.table / temperature, dim=-1)
    q = torch.softmax(drafter.table / temperature, dim=-1)
    expected = {seq: float(p[1, seq[0]] * p[seq[0], seq[1]]) for seq in itertools.product(range(3), repeat=length)}
    drafters = {seq: float(q[1, seq[0]] * q[seq[0], seq[1]]) for seq in expected}
    assert max(abs(expected[s] - drafters[s]) for s in expected) > 0.1  # the drafter's own law would fail below
    assert set(found) <= set(expected)
    # The procedure runs in float32 (softmax, ratios); each path's probability is a product of a few float32
    # numbers (relative error ~1e-6) and every outcome's a sum of such products, which total 1: 1e-5 bounds it.
    for seq, probability in expected.items():
        assert found.get(seq, 0.0) == pytest.approx(probability, abs=1e-5)


def test_a_draft_is_kept_with_probability_one_minus_total_variation(bigrams):
    target, drafter = bigrams
    for last in range(3):
        found = exact_distribution(lambda rng, last=last: speculative.speculative_decode(
            target, drafter, torch.tensor([last]), gamma=1, max_new_tokens=1, mode="sampled", rng=rng).accepted[0])
        tv = functional.total_variation(drafter.table[last:last + 1], target.table[last:last + 1])  # float64
        assert found[1] == pytest.approx(1.0 - float(tv), abs=1e-6)  # float32 ratios summed over 3 tokens


def test_transformers_assisted_generation_keeps_the_same_drafts(gpt2_pair):
    """Set to a constant draft length and no confidence threshold (settings transformers reads from the assistant's
    own generation config, not from generate's arguments), transformers' assisted generation is this loop: the same
    greedy tokens and the same drafts kept in each round. Its rounds are read from the target's calls: call i reads
    ``1 + drafts_i`` new tokens (the first, the prompt and its drafts) up to position ``position_ids[-1]``, so the text
    grew by ``kept_i + 1`` between calls. Near ``max_new_tokens`` it drafts fewer than gamma, which this loop never
    does (it cuts the output instead): those last rounds are left out."""
    target, drafter = gpt2_pair
    gamma, new = 3, 16
    calls = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: None if calls and calls[-1] is None else calls.append(
            (kwargs["input_ids"].shape[1], int(kwargs["position_ids"][0, -1]))),
        with_kwargs=True)
    saved = drafter.generation_config
    drafter.generation_config = copy.deepcopy(saved)
    drafter.generation_config.update(num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant",
                                     assistant_confidence_threshold=0.0)
    try:
        for prompt in prompts(2):
            calls.clear()
            hf = target.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), assistant_model=drafter,
                                 do_sample=False, max_new_tokens=new, eos_token_id=None,
                                 pad_token_id=EOS)[0, len(prompt):]
            drafts = [calls[0][0] - len(prompt)] + [n - 1 for n, _ in calls[1:]]
            text = [last + 1 - d for (_, last), d in zip(calls, drafts, strict=True)]
            kept = [b - a - 1 for a, b in zip(text, text[1:], strict=False)]
            full = kept[:next((i for i, d in enumerate(drafts) if d < gamma), len(kept))]
            calls.append(None)  # our loop's calls below are not recorded
            ours = speculative.speculative_decode(target, drafter, prompt, gamma=gamma, max_new_tokens=new)
            assert hf.tolist() == ours.tokens.tolist()
            assert len(full) >= 3 and full == ours.accepted[:len(full)]
    finally:
        handle.remove()
        drafter.generation_config = saved


def test_latencies_and_the_speedup_they_predict(gpt2_pair):
    target, drafter = gpt2_pair
    figures = speculative.evaluate_drafters(target, {"d": drafter}, prompts(2), gamma=2, max_new_tokens=6,
                                            latency_repeats=1)["d"]
    assert figures["rounds"] >= 3 and 1 <= figures["tau"] <= 3
    for key in ("target_step_s", "target_verify_s", "drafter_step_s"):
        assert figures[key] > 0
    round_s = 2 * figures["drafter_step_s"] + figures["target_verify_s"]
    assert figures["predicted_speedup"] == pytest.approx(figures["tau"] * figures["target_step_s"] / round_s)


def test_target_verified_loss_against_a_float64_loop():
    """The weights by their definition, token by token: reach = product of a over the round's earlier drafts
    (rounds of gamma counted tokens from each row's first), times 1 + w (1 - a); the loss sum_t weight_t TV_t over
    the counted tokens."""
    from losses import build_loss

    generator = torch.Generator().manual_seed(5)
    batch_size, length, vocab, gamma, rejected = 2, 9, 7, 3, 0.5
    student = torch.randn(batch_size, length, vocab, generator=generator, dtype=torch.float64)
    teacher = torch.randn(batch_size, length, vocab, generator=generator, dtype=torch.float64) * 2
    ids = torch.randint(0, vocab, (batch_size, length), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt of 3 tokens: row 0 drafts from its position 2 on (predicting token 3)
    labels[1, 7:] = -100  # row 1 stops early
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    loss = build_loss({"name": "target_verified", "gamma": gamma, "rejected_weight": rejected})
    got = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=teacher), batch).total
    total, count = 0.0, 0
    for row in range(batch_size):
        drafted = [t for t in range(length - 1) if labels[row, t + 1] != -100]
        reach = 1.0
        for k, t in enumerate(drafted):
            p, q = torch.softmax(teacher[row, t], -1), torch.softmax(student[row, t], -1)
            x = int(ids[row, t + 1])
            a = min(1.0, float(p[x] / q[x]))
            if k % gamma == 0:
                reach = 1.0
            total += reach * (1 + rejected * (1 - a)) * float(0.5 * (p - q).abs().sum())
            reach *= a
            count += 1
    assert float(got) == pytest.approx(total / count, rel=1e-12)  # float64 throughout: rounding only


def test_greedy_rounds_from_one_drafter_forward_are_the_loops(gpt2_pair):
    target, drafter = gpt2_pair
    for prompt in prompts(3):
        for gamma in (1, 4):
            loop = speculative.speculative_decode(target, drafter, prompt, gamma=gamma, max_new_tokens=17).accepted
            fast = speculative.greedy_accepted(target, drafter, prompt, gamma=gamma, max_new_tokens=17)
            assert fast == loop
    assert speculative.greedy_rounds([True, True, False, True, True, True, True, True], 3, 8) == [2, 3, 1]
