"""Speculative decoding as an exact evaluation: how many of a drafter's tokens its target accepts.

A drafter (a student) proposes ``gamma`` tokens a round; the target (the teacher) scores all of them in one forward
on ``gamma + 1`` positions and keeps a prefix, then adds one token of its own (the correction at the first rejected
position, or a bonus token after the last draft when all are kept). A round therefore yields between 1 and
``gamma + 1`` tokens, and its mean over rounds, **tau**, is what a drafter buys: each round costs one target
forward and ``gamma`` drafter steps, so the speed-up over the target alone is
``tau * T_target_step / (gamma * T_drafter_step + T_target_verify)`` (Leviathan et al. 2023, section 3.4;
Chen et al. 2023), where the target's verify forward on ``gamma + 1`` tokens costs about one decode step on an
accelerator, and much more on a CPU.

* ``greedy``: drafts are the drafter's argmax; a draft is kept while it equals the target's argmax. The output is
  the target's greedy output, token for token.
* ``sampled``: drafts are sampled from the drafter's q; draft x is kept with probability min(1, p(x) / q(x)), and
  at the first rejection the target's token is drawn from norm(max(0, p - q)) (the modified rejection sampling of
  Leviathan et al., Chen et al.). The output's distribution is the target's. A draft is kept with probability
  sum_x min(p, q) = 1 - TV(p, q), which is why total variation is the drafter's objective (DistillSpec).

Why our own loop and not transformers' assisted generation (``generate(assistant_model=...)``): that loop returns
tokens only, not the accepted count of each round, and by default changes its draft length as it goes
(``num_assistant_tokens_schedule``) and stops drafting below a confidence threshold; set to a constant
``gamma`` and no threshold, its greedy output and its number of target calls are those of :func:`speculative_decode`
(``tests/test_speculative.py`` checks it). Here each round recomputes the prefix without a KV cache: the figures
are exact and the code is the definition; the latencies that predict the speed-up are measured with a cache
(:func:`measure_latencies`), as a server would run. In greedy mode the evaluation takes the same rounds from one
drafter forward over the target's greedy output (:func:`greedy_accepted`), tested equal to the loop's.

Randomness is drawn through a :class:`Randomness` object (a categorical draw and a coin), so a test can replace it
with one that enumerates every branch and gets the exact output distribution.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

Mode = Literal["greedy", "sampled"]


class Randomness(Protocol):
    def categorical(self, probs: torch.Tensor) -> int:
        """An index drawn with probabilities ``probs`` (1-D, summing to 1)."""

    def bernoulli(self, prob: float) -> bool:
        """True with probability ``prob``."""


class TorchRandomness:
    """Draws from a seeded ``torch.Generator`` on the CPU: the same seed, the same rounds, on any device."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def categorical(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs.detach().double().cpu(), 1, generator=self.generator))

    def bernoulli(self, prob: float) -> bool:
        return bool(torch.rand((), generator=self.generator, dtype=torch.float64) < prob)


@dataclass
class Decoded:
    """One prompt's speculative decoding: the tokens it produced and the drafts kept in each round (0..gamma)."""

    tokens: torch.Tensor
    accepted: list[int] = field(default_factory=list)


def _logits(model: nn.Module, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Float32 logits ``(len(ids), vocab)`` of a causal LM on one row; a vocabulary padded past ``vocab`` is cut
    (a teacher's padded rows are never a token of the drafter's)."""
    return model(input_ids=ids.unsqueeze(0)).logits[0, :, :vocab].float()


def reads_features(drafter: nn.Module) -> bool:
    """A drafter that reads its target's hidden states (``students/feature_drafter.py``: EAGLE-3's design)."""
    return bool(getattr(drafter, "reads_teacher_features", False))


def _feature_steps(target: nn.Module, drafter: nn.Module, ids: torch.Tensor, vocab: int):
    """A round's draft steps of a feature-reading drafter on the verified text ``ids``: the first reads the
    target's features of the verified prefix (one target forward with its hidden states), each later one the
    drafter's own previous hidden state in their place (EAGLE). Uncached, as the rest of the loop: each step is a
    forward over the whole row. Returns ``step(row) -> logits`` of the row's next token."""
    features = drafter.teacher_features(target(input_ids=ids.unsqueeze(0), output_hidden_states=True).hidden_states)

    def step(row: torch.Tensor) -> torch.Tensor:
        nonlocal features
        out = drafter(input_ids=row.unsqueeze(0), features=features)
        features = torch.cat([features, out.hidden[:, -1:]], dim=1)  # the next position's stand-in for the target
        return out.logits[0, -1, :vocab].float()

    return step


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """``target_logits`` ``(gamma + 1, V)`` at the positions that predict each draft and the token after them:
    (drafts kept, the target's own next token)."""
    choice = target_logits.argmax(-1)
    kept = 0
    while kept < len(drafts) and int(drafts[kept]) == int(choice[kept]):
        kept += 1
    return kept, int(choice[kept])


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, rng: Randomness) -> tuple[int, int]:
    """Modified rejection sampling: ``p`` ``(gamma + 1, V)`` the target's probabilities, ``q`` ``(gamma, V)`` the
    drafter's, ``drafts`` drawn from ``q``. (drafts kept, the next token: from norm(max(0, p - q)) at the first
    rejection, else from p after the last draft)."""
    for i, draft in enumerate(drafts.tolist()):
        ratio = float(p[i, draft] / q[i, draft])
        if ratio >= 1.0 or rng.bernoulli(ratio):
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        total = residual.sum()
        # A rejection has probability sum(max(0, q - p)) = sum(max(0, p - q)): with a residual of no mass it could
        # only come from rounding, and p itself is then the residual's limit.
        return i, rng.categorical(residual / total if total > 0 else p[i])
    return len(drafts), rng.categorical(p[len(drafts)])


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.softmax(logits / temperature, dim=-1)


@torch.no_grad()
def speculative_decode(target: nn.Module, drafter: nn.Module, prompt: torch.Tensor, *, gamma: int,
                       max_new_tokens: int, mode: Mode = "greedy", temperature: float = 1.0,
                       eos_token_id: int | None = None, rng: Randomness | None = None,
                       vocab: int | None = None) -> Decoded:
    """``prompt`` (1-D ids) continued by speculative decoding, up to ``max_new_tokens`` tokens or the end token.

    Every round decides all of its ``gamma`` drafts, also past the end token or the length limit (whose tokens are
    then cut from the output): each round's accepted count is a draw of the same law, so tau is not biased by
    where generation stops.
    """
    if gamma < 1:
        raise ValueError(f"gamma={gamma}: a drafter proposes at least one token a round")
    rng = rng if rng is not None else TorchRandomness(0)
    vocab = vocab or min(target.config.vocab_size, drafter.config.vocab_size)
    ids = prompt.clone()
    out: list[int] = []
    accepted: list[int] = []
    while len(out) < max_new_tokens and not (eos_token_id is not None and eos_token_id in out):
        drafts, q_rows, row = [], [], ids
        draft_step = _feature_steps(target, drafter, ids, vocab) if reads_features(drafter) else (
            lambda row: _logits(drafter, row, vocab)[-1])
        for _ in range(gamma):
            logits = draft_step(row)
            if mode == "greedy":
                token = int(logits.argmax())
            else:
                q_rows.append(_probs(logits, temperature))
                token = rng.categorical(q_rows[-1])
            drafts.append(token)
            row = torch.cat([row, row.new_tensor([token])])
        target_logits = _logits(target, row, vocab)[-(gamma + 1):]
        drafted = torch.tensor(drafts)
        if mode == "greedy":
            kept, following = verify_greedy(target_logits, drafted)
        else:
            kept, following = verify_sampled(_probs(target_logits, temperature), torch.stack(q_rows), drafted, rng)
        accepted.append(kept)
        new = drafts[:kept] + [following]
        out += new
        ids = torch.cat([ids, ids.new_tensor(new)])
    if eos_token_id is not None and eos_token_id in out:
        out = out[:out.index(eos_token_id) + 1]
    return Decoded(torch.tensor(out[:max_new_tokens], dtype=torch.long), accepted)


def greedy_rounds(matches: Sequence[bool], gamma: int, max_new_tokens: int) -> list[int]:
    """The drafts kept in each round of greedy speculative decoding, from ``matches[k]``: whether the drafter's argmax
    after the prompt and the target's first ``k`` greedy tokens is the target's token ``k``.

    Greedy speculative decoding outputs the target's greedy tokens, and while a round's drafts are kept the drafter
    reads exactly those tokens: a round that starts at token ``j`` keeps the run of matches from ``j`` on (at most
    ``gamma``), then adds the target's token. So one teacher-forced drafter forward over the target's greedy output
    gives every round, as :func:`speculative_decode` would draw them (``tests/test_speculative.py`` checks both)."""
    rounds, start = [], 0
    while start < max_new_tokens:
        kept = 0
        while kept < gamma and start + kept < len(matches) and matches[start + kept]:
            kept += 1
        rounds.append(kept)
        start += kept + 1
    return rounds


@torch.no_grad()
def greedy_accepted(target: nn.Module, drafter: nn.Module, prompt: torch.Tensor, *, gamma: int,
                    max_new_tokens: int, vocab: int | None = None, text: torch.Tensor | None = None) -> list[int]:
    """:func:`speculative_decode`'s accepted counts in greedy mode without its loop: the target's greedy tokens (its
    own decode loop with a KV cache), then one drafter forward over them. No end token stops it (as the loop's
    ``eos_token_id`` None), and ``gamma`` tokens more than ``max_new_tokens`` are decoded so that the last round's
    drafts are all judged, as the loop judges them. Where two logits tie to float rounding, a cached step and the
    loop's uncached forward may pick different argmaxes: the figures are the same up to such ties. ``text``: the
    prompt and those tokens when already decoded (several drafters measured on one target)."""
    vocab = vocab or min(target.config.vocab_size, drafter.config.vocab_size)
    if text is None:
        text = target_greedy_text(target, prompt, max_new_tokens + gamma, vocab)
    if reads_features(drafter):
        return feature_greedy_rounds(target, drafter, text, len(prompt), gamma=gamma, max_new_tokens=max_new_tokens,
                                     vocab=vocab)
    drafts = _logits(drafter, text[:-1], vocab)[len(prompt) - 1:].argmax(-1)
    return greedy_rounds((drafts == text[len(prompt):]).tolist(), gamma, max_new_tokens)


@torch.no_grad()
def target_greedy_text(target: nn.Module, prompt: torch.Tensor, new_tokens: int, vocab: int) -> torch.Tensor:
    """``prompt`` and the target's next ``new_tokens`` greedy tokens (its own decode loop with a KV cache)."""
    out = target(input_ids=prompt.unsqueeze(0), use_cache=True)
    cache, tokens = out.past_key_values, [int(out.logits[0, -1, :vocab].argmax())]
    while len(tokens) < new_tokens:
        out = target(input_ids=prompt.new_tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1, :vocab].argmax()))
    return torch.cat([prompt, prompt.new_tensor(tokens)])


@torch.no_grad()
def feature_greedy_rounds(target: nn.Module, drafter: nn.Module, text: torch.Tensor, prompt_length: int, *,
                          gamma: int, max_new_tokens: int, vocab: int) -> list[int]:
    """Greedy rounds of a feature-reading drafter over the target's greedy ``text`` (prompt + its tokens), from one
    target forward and one ``gamma``-step unroll (``FeatureDrafter.unrolled``). A round whose verified text ends
    at index ``j`` drafts token ``j + m`` at draft step ``m``, position ``j + m - 1``; while its drafts are kept
    they are the text's tokens, so the unroll fed the text is what the loop computes, up to its first rejection."""
    hidden_states = target(input_ids=text.unsqueeze(0), output_hidden_states=True).hidden_states
    steps = drafter.unrolled(text.unsqueeze(0), hidden_states, steps=gamma)
    predicted = torch.stack([step.logits[0, :, :vocab].argmax(-1) for step in steps])  # (gamma, T)
    rounds, last = [], prompt_length - 1  # index of the last verified token
    while last - (prompt_length - 1) < max_new_tokens:
        kept = 0
        while kept < gamma and last + kept + 1 < len(text) and int(predicted[kept, last + kept]) == int(
                text[last + kept + 1]):
            kept += 1
        rounds.append(kept)
        last += kept + 1
    return rounds


def acceptance_figures(accepted: Sequence[int], gamma: int) -> dict[str, Any]:
    """tau (mean tokens a round, accepted drafts + 1), the rounds, and the acceptance rate at each draft position:
    of the rounds that reached draft i (every earlier one kept), the share that kept it (None where none reached it:
    JSON has no NaN)."""
    rounds = len(accepted)
    reached = [sum(1 for a in accepted if a >= i) for i in range(gamma)]
    kept = [sum(1 for a in accepted if a > i) for i in range(gamma)]
    return {"tau": (sum(accepted) + rounds) / rounds if rounds else float("nan"), "rounds": rounds,
            "acceptance_by_position": [k / r if r else None for k, r in zip(kept, reached, strict=True)]}


def _timed(step, repeats: int, device: torch.device) -> float:
    """Median seconds of ``step()`` over ``repeats`` calls after one warm-up."""
    step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@torch.no_grad()
def forward_latency(model: nn.Module, prompt: torch.Tensor, new_tokens: int, repeats: int = 5) -> float:
    """Seconds of one forward of ``new_tokens`` tokens after ``prompt`` already in the model's KV cache (a decode
    step for 1 token, the target's verification for ``gamma + 1``); the cache is cut back after each call."""
    out = model(input_ids=prompt.unsqueeze(0), use_cache=True)
    cache = out.past_key_values
    new = prompt.new_zeros((1, new_tokens))

    def step() -> None:
        model(input_ids=new, past_key_values=cache, use_cache=True)
        cache.crop(-new_tokens)  # transformers 5: a negative count of tokens to drop

    return _timed(step, repeats, prompt.device)


def measure_latencies(target: nn.Module, drafter: nn.Module, prompt: torch.Tensor, gamma: int,
                      repeats: int = 5) -> dict[str, float]:
    """The three latencies the speed-up is predicted from, measured on the models' device."""
    return {"target_step_s": forward_latency(target, prompt, 1, repeats),
            "target_verify_s": forward_latency(target, prompt, gamma + 1, repeats),
            "drafter_step_s": (feature_step_latency(drafter, prompt, repeats) if reads_features(drafter) else
                               forward_latency(drafter, prompt, 1, repeats))}


@torch.no_grad()
def feature_step_latency(drafter: nn.Module, prompt: torch.Tensor, repeats: int = 5) -> float:
    """Seconds of a feature-reading drafter's decode step (one token and one feature after ``prompt`` in its
    KV cache; the features' values do not change the time)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    rows = prompt if prompt.dim() == 2 else prompt.unsqueeze(0)
    features = torch.zeros(*rows.shape, drafter.hidden_size, dtype=drafter.fc.weight.dtype, device=rows.device)
    drafter(input_ids=rows, features=features, cache=cache)
    new, feature = rows[:, :1], features[:, :1]

    def step() -> None:
        drafter(input_ids=new, features=feature, cache=cache)
        cache.crop(-1)

    return _timed(step, repeats, prompt.device)


def predicted_speedup(tau: float, gamma: int, latencies: Mapping[str, float]) -> float:
    """Tokens a second of speculative decoding over the target's alone: tau tokens for gamma drafter steps and one
    verification, against one token a target step (the drafter's catch-up on the kept tokens is left out)."""
    round_s = gamma * latencies["drafter_step_s"] + latencies["target_verify_s"]
    return tau * latencies["target_step_s"] / round_s


def evaluate_drafters(target: nn.Module, drafters: Mapping[str, nn.Module], prompts: Sequence[torch.Tensor], *,
                      gamma: int, max_new_tokens: int, mode: Mode = "greedy", temperature: float = 1.0,
                      eos_token_id: int | None = None, seed: int = 0, latency_repeats: int = 5
                      ) -> dict[str, dict[str, Any]]:
    """Each drafter's figures over ``prompts``: tau, rounds, acceptance by position, the latencies measured on the
    first prompt and the speed-up they predict. Each drafter draws from its own generator seeded ``seed``."""
    results = {}
    texts: dict[int, torch.Tensor] = {}  # greedy: the target's text of each prompt, decoded once for every drafter
    for name, drafter in drafters.items():
        was_training = drafter.training
        drafter.eval()
        try:
            rng = TorchRandomness(seed)
            accepted: list[int] = []
            for i, prompt in enumerate(prompts):
                if mode == "greedy" and eos_token_id is None:  # the same rounds, one drafter forward a prompt
                    vocab = min(target.config.vocab_size, drafter.config.vocab_size)
                    if i not in texts:
                        texts[i] = target_greedy_text(target, prompt, max_new_tokens + gamma, vocab)
                    accepted += greedy_accepted(target, drafter, prompt, gamma=gamma, max_new_tokens=max_new_tokens,
                                                vocab=vocab, text=texts[i])
                    continue
                accepted += speculative_decode(target, drafter, prompt, gamma=gamma, max_new_tokens=max_new_tokens,
                                               mode=mode, temperature=temperature, eos_token_id=eos_token_id,
                                               rng=rng).accepted
            figures = acceptance_figures(accepted, gamma)
            latencies = measure_latencies(target, drafter, prompts[0], gamma, latency_repeats)
            figures |= latencies | {"predicted_speedup": predicted_speedup(figures["tau"], gamma, latencies),
                                    "gamma": gamma, "mode": mode,
                                    "method": "eagle3" if reads_features(drafter) else "draft_model"}
        finally:
            drafter.train(was_training)
        results[name] = figures
    return results
