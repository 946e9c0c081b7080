"""The run's rewards on a sampled micro-batch: each sample scored, each group's scores turned into advantages.

After the sampler has answered every row (``on_policy.py``; ``samples_per_prompt`` copies of each prompt side by
side), the :class:`Rewarder` decodes each row's prompt and sample, calls every reward that applies to the row (all,
or with ``combine: route`` those given the row's teacher), sums them by weight, and adds to the micro-batch::

    rewards     (B,) float32   each sample's reward
    advantages  (B,) float32   GRPO's: the reward minus its group's mean, over the group's std (losses/functional.py)
    no_signal   (B,) bool      the row's group has all-equal rewards (advantage 0: nothing to learn from it)

which a ``policy_gradient`` loss reads (``losses/policy.py``). Each rank scores its own rows; a reward's answer is
checked (a finite number), and a reward that fails stops the run cleanly (``RewardFailed``: the loop's checkpoint of
the last whole step, then an exit that ``--resume`` continues from).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from distill_kit.config import RewardsConfig
from distill_kit.errors import ConfigError, RewardFailed
from distill_kit.rewards import RewardFunction, resolve
from distill_kit.training.on_policy import prompt_of
from losses.base import IGNORE_INDEX
from losses.functional import group_advantages
from losses.policy import PolicyGradient

Batch = dict[str, Any]


class Rewarder:
    """``rewards``: each reward resolved (the plan's), beside its spec (weight, teacher). ``teachers``: the run's
    teacher names in order, which a routed batch's ``teacher_id`` indexes."""

    def __init__(self, config: RewardsConfig, rewards: Sequence[RewardFunction], tokenizer: Any, group_size: int,
                 teachers: Sequence[str] = ()):
        self.config, self.rewards, self.tokenizer = config, list(rewards), tokenizer
        self.group_size, self.teachers = group_size, list(teachers)

    def __call__(self, batch: Mapping[str, Any], where: str = "") -> Batch:
        labels, ids = batch["labels"], batch["input_ids"]
        asked = sorted({field for reward in self.rewards for field in reward.fields})
        if asked and "records" not in batch:
            raise ConfigError(f"rewards ask for the record fields {asked}, and the batches carry no records: build "
                              "the chat splits with keep_fields=True (data.chat.build_splits; the CLI does it)")
        scores = []
        for row in range(ids.shape[0]):
            prompt_ids, sample_ids = prompt_of(batch, row).tolist(), labels[row][labels[row] != IGNORE_INDEX].tolist()
            teacher = self.teachers[int(batch["teacher_id"][row])] if "teacher_id" in batch else None
            record = batch["records"][row] if "records" in batch else None
            scores.append(self.score(prompt_ids, sample_ids, teacher, record, f"row {row}{where}"))
        rewards = torch.tensor(scores, dtype=torch.float64)
        groups = rewards.reshape(-1, self.group_size)
        no_signal = (groups == groups[:, :1]).all(dim=1).repeat_interleave(self.group_size)
        advantages = group_advantages(rewards, self.group_size, self.config.scale_by_std)
        device = ids.device
        return dict(batch) | {"rewards": rewards.float().to(device), "advantages": advantages.float().to(device),
                              "no_signal": no_signal.to(device)}

    def score(self, prompt_ids: list[int], sample_ids: list[int], teacher: str | None,
              record: Mapping[str, Any] | None, where: str) -> float:
        """One sample's reward: the weighted sum of the rewards that apply to its teacher's conversations; ``record``:
        the fields of the record its prompt came from (batches of ``keep_fields`` chat data carry them)."""
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        completion = self.tokenizer.decode(sample_ids, skip_special_tokens=True)
        total = 0.0
        for spec, reward in zip(self.config.functions, self.rewards, strict=True):
            if spec.teacher is not None and spec.teacher != teacher:
                continue
            try:
                total += spec.weight * reward(prompt, completion, prompt_ids, sample_ids, record)
            except Exception as err:  # whatever a user's function raises: named once, the run stopped cleanly
                raise RewardFailed(f"reward {spec.name!r} failed on the prompt {_short(prompt)} ({where}), sample "
                                   f"{_short(completion)}: {type(err).__name__}: {err}. Fix the reward, then continue "
                                   "with --resume") from None
        return total


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_fields(rewards: Sequence[RewardFunction], fields: frozenset[str] | None, where: str) -> None:
    """Every record field the rewards ask for is in every record of the training data (``fields``: the fields every
    record has, ``ChatStats.fields``); one ``ConfigError`` naming the reward, the fields and the fix."""
    for i, reward in enumerate(rewards):
        missing = [field for field in reward.fields if field not in (fields or ())]
        if missing:
            raise ConfigError(f"training.rewards.functions[{i}] ({reward.name!r}) asks for the record field(s) "
                              f"{missing}, which not every record of {where} has (all have {sorted(fields or ())}): "
                              "add them to every record, or give the parameter a default")


def plan_rewards(config: RewardsConfig, losses: Mapping[str, Any], on_policy: Any, teachers: Sequence[str],
                 dense: Mapping[str, bool], combine: str, chat: bool) -> tuple[list[RewardFunction], list[str]]:
    """The plan's part (``training/plan.py``): each reward resolved and its signature checked, and every way the
    run's rewards and ``policy_gradient`` losses cannot work together, each naming the key and the fix.
    ``losses``: each student's loss; ``dense``: each teacher's, whether it returns a full distribution; ``chat``:
    the data is chat records (prompts to answer)."""
    problems, rewards = [], []
    if config.on and not chat:
        problems.append("training.rewards score answers to prompts, and the data is text (blocks with no prompt): "
                        "give chat or prompt/completion records (data.format: chat; docs/chat.md; from Python, "
                        "Distiller(..., data=DataFacts(kind='chat')))")
    for i, spec in enumerate(config.functions):
        key = f"training.rewards.functions[{i}]"
        try:
            rewards.append(resolve(spec.name, f"{key}.name"))
        except ConfigError as err:
            problems.append(str(err))
        if spec.teacher is not None and (combine != "route" or spec.teacher not in teachers):
            problems.append(f"{key}.teacher: {spec.teacher!r} scores the conversations routed to that teacher, and "
                            + (f"this run does not route (combine: {combine}): drop teacher, or route"
                               if combine != "route" else f"the run's teachers are {list(teachers)}"))
    if config.on and on_policy.pack_to:
        problems.append("training.rewards compare each prompt's samples side by side, and on_policy.pack_to packs "
                        "them into shared rows: set training.on_policy.pack_to: 0 (data.packing: false)")
    for student, loss in losses.items():
        for term in _policy_terms(loss):
            if on_policy.fraction == 0 or on_policy.sampler != "student":
                problems.append(f"students[{student}].loss policy_gradient trains on the student's own samples, and "
                                "this run has none: set training.on_policy.fraction: 1.0 (sampler: student)")
            if term.needs_rewards and not config.on:
                problems.append(f"students[{student}].loss policy_gradient has reward: {term.reward_weight}, and the "
                                "run has no rewards: add training.rewards.functions (e.g. [{name: arithmetic}]), or "
                                "set reward: 0")
            sparse = [name for name, full in dense.items() if not full]
            if term.needs_teacher and sparse:
                problems.append(f"students[{student}].loss policy_gradient has teacher: {term.teacher_weight}, which "
                                f"needs each sampled token's teacher log-probability, and teachers {sparse} return "
                                "only their top k: use an in-process teacher, or teacher: 0")
    return rewards, problems


def _policy_terms(loss: Any) -> list[PolicyGradient]:
    """The ``policy_gradient`` terms of a loss (alone, in a weighted sum, or one per teacher)."""
    return [module for module in loss.modules() if isinstance(module, PolicyGradient)]
