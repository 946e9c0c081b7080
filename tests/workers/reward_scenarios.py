"""Runs with rewards on a real DeepSpeed engine (one rank); launched by tests/test_rewards.py.

The arithmetic task's shipped teacher (a 4-layer Llama of 19 tokens, with its tokenizer) teaches a 2-layer student
of its shape on the task's prompts; the student samples at temperature 1 (a group of equal greedy samples has no
signal). The reward counts the digit 1 in a sample: varied from the first step, unlike the task's checker on an
untrained student. Each scenario writes ``<out>/<name>.rank0.json``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import Recording, gathered, max_diff, plain_adamw, write  # noqa: E402

from distill_kit import Distiller, TrainingConfig  # noqa: E402
from distill_kit.config import RewardsConfig, RewardSpec  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402
from distill_kit.rewards import register  # noqa: E402
from distill_kit.tasks import arithmetic  # noqa: E402
from distill_kit.training.on_policy import OnPolicyConfig  # noqa: E402
from distill_kit.training.plan import DataFacts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEACHER = ROOT / "distill_kit/assets/arithmetic/teacher"
STEPS, GAS, GROUP, PROMPTS, NEW = 3, 2, 4, 2, 8  # a micro-batch: 2 prompts x 4 samples
ON_POLICY = OnPolicyConfig(fraction=1.0, max_new_tokens=NEW, temperature=1.0, cache="dynamic")
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=PROMPTS * GROUP, gradient_accumulation_steps=GAS,
                          lr=3e-3, weight_decay=0.01, max_grad_norm=0.5, log_every=100, lr_schedule="constant",
                          on_policy=replace(ON_POLICY, samples_per_prompt=GROUP),
                          rewards=RewardsConfig(functions=(RewardSpec(name="ones"),)))
FAIL_AT: list[int] = []  # the reward raises at this call (counted from 1), when set
CALLS = [0]


@register("ones")
def ones(prompt: str, completion: str) -> float:
    """How many times the digit 1 appears in the sample; raises at call FAIL_AT[0] when a scenario sets it."""
    CALLS[0] += 1
    if FAIL_AT and CALLS[0] == FAIL_AT[0]:
        raise RuntimeError("the reward's service is down")
    return float(completion.count("1"))


def student_folder(out: Path) -> Path:
    """A 2-layer student of the teacher's shape and tokenizer, from seed 0, written once."""
    path = out / "student"
    if distributed.is_main() and not path.exists():
        config = LlamaConfig.from_pretrained(TEACHER)
        config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 64, 128
        config.num_attention_heads = config.num_key_value_heads = 2
        config.head_dim = 32
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        AutoTokenizer.from_pretrained(TEACHER).save_pretrained(path)
    distributed.barrier()
    return path


def prompt_batches(count: int, prompts: int, seed: int) -> list[dict]:
    """Micro-batches of ``prompts`` arithmetic prompts (no answers), left as the chat template renders them."""
    tokenizer = AutoTokenizer.from_pretrained(TEACHER)
    items = iter(arithmetic.examples(seed))
    out = []
    for _ in range(count):
        rows = [arithmetic.encode(tokenizer, next(items), with_answer=False)[0] for _ in range(prompts)]
        out.append({"input_ids": torch.tensor(rows), "attention_mask": torch.ones(len(rows), len(rows[0])).long(),
                    "labels": torch.full((len(rows), len(rows[0])), -100)})
    return out



def distiller(out: Path, loss, training: TrainingConfig = TRAINING, cls=Recording) -> Distiller:
    return cls(str(student_folder(out)), str(TEACHER), loss=loss, training=training, data=DataFacts(kind="chat"))


def weight_zero(out: Path) -> None:
    """Today's on-policy reverse KL, and the same with rewards scored and a policy-gradient term of weight 0."""
    plain = replace(TRAINING, on_policy=ON_POLICY, rewards=RewardsConfig(), micro_batch_size=PROMPTS)
    data = prompt_batches(STEPS * GAS, PROMPTS, seed=1)
    runs = []
    for loss, training in (("reverse_kl", plain),
                           ([{"name": "reverse_kl", "weight": 1.0},
                             {"name": "policy_gradient", "weight": 0.0, "teacher": 0.0, "reward": 1.0}],
                            replace(plain, rewards=TRAINING.rewards))):
        torch.manual_seed(0)
        run = distiller(out, loss, training)
        history = run.train(data)
        runs.append((history, gathered(run.student_model), run.made))
    (before, params_before, _), (after, params_after, made) = runs
    write(out, "weight_zero", {
        "losses": [h["loss"] for h in before], "losses_with_rewards": [h["loss"] for h in after],
        "reverse_kl_with_rewards": [h["reverse_kl"] for h in after],
        "reward_means": [h["reward_mean"] for h in after],
        "identical_params": all(torch.equal(a, b) for a, b in zip(params_before, params_after, strict=True)),
        "scored": all("rewards" in b for b in made)})


def plain_grpo(student_dir: Path, made: list[dict], dtype: torch.dtype, reuse: int = 1,
               training: TrainingConfig = TRAINING) -> list[torch.Tensor]:
    """GRPO written out in plain PyTorch over the micro-batches the engine sampled: each sample's reward recomputed
    from its decoded text, each group's advantage (r - mean) / (std + 1e-4), the surrogate
    -min(r A, clip(r, 0.8, 1.2) A) summed over every sampled token of the step and divided by their count; AdamW,
    the global norm clipped, as the engine's optimizer step. Each rollout (a step's micro-batches) is trained on at
    ``reuse`` steps: at the first r = p / p held constant (1), at the others r = p / p_old, p_old the probability
    at the first step's weights, before its update."""
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=dtype)
    opt = plain_adamw(student.parameters(), training)
    old: list[torch.Tensor] = []
    for s in range(STEPS):
        rollout = s // reuse
        step = made[rollout * GAS:(rollout + 1) * GAS]
        fresh = s % reuse == 0
        if fresh:
            old = []
        total, tokens = 0.0, 0
        for i, b in enumerate(step):
            rewards = []
            for row in range(b["input_ids"].shape[0]):
                sample = b["labels"][row][b["labels"][row] != -100].tolist()
                rewards.append(tokenizer.decode(sample, skip_special_tokens=True).count("1"))
            advantages = []
            for g in range(0, len(rewards), GROUP):
                group = rewards[g:g + GROUP]
                mean = sum(group) / GROUP
                std = math.sqrt(sum((r - mean) ** 2 for r in group) / (GROUP - 1))
                advantages += [(r - mean) / (std + 1e-4) for r in group]
            logits = student(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
            labels = b["labels"][:, 1:]
            valid = labels != -100
            log_p = F.log_softmax(logits.to(dtype), -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
            if fresh:
                old.append(log_p.detach())
            ratio = torch.exp(log_p - (log_p.detach() if fresh else old[i]))
            advantage = torch.tensor(advantages, dtype=dtype)[:, None]
            per_token = -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
            total, tokens = total + (per_token * valid).sum(), tokens + int(valid.sum())
        opt.zero_grad()
        (total / tokens).backward()
        torch.nn.utils.clip_grad_norm_(list(student.parameters()), TRAINING.max_grad_norm)
        opt.step()
    return [p.detach().float() for p in student.parameters()]


def grpo(out: Path) -> None:
    """teacher: 0, reward: 1 (plain GRPO) against the plain-PyTorch loop in float32 and float64."""
    torch.manual_seed(0)
    run = distiller(out, {"name": "policy_gradient", "teacher": 0.0, "reward": 1.0})
    history = run.train(prompt_batches(STEPS * GAS, PROMPTS, seed=2))
    ours = gathered(run.student_model)
    start = [p.detach().float() for p in AutoModelForCausalLM.from_pretrained(student_folder(out)).parameters()]
    ref32, ref64 = (plain_grpo(student_folder(out), run.made, dtype) for dtype in (torch.float32, torch.float64))
    groups = [b["rewards"].reshape(-1, GROUP) for b in run.made]
    write(out, "grpo", {
        "max_param_diff": max_diff(ours, ref32), "ours_vs_float64": max_diff(ours, ref64),
        "ref_vs_float64": max_diff(ref32, ref64), "max_param_change": max_diff(ours, start),
        "teacher_forwards": run.teacher_forwards, "rows": [b["input_ids"].shape[0] for b in run.made],
        "groups_with_signal": sum(int((g != g[:, :1]).any(1).sum()) for g in groups),
        "prompts_per_group": [int((b["input_ids"][:, :7].reshape(-1, GROUP, 7) == b["input_ids"][::GROUP, None, :7])
                                  .all().item()) for b in run.made],
        "record_keys": sorted(history[-1])})


def stale(out: Path) -> None:
    """``updates_per_rollout: 2`` (plain GRPO): step 1 samples, step 2 trains on step 1's samples again (stale:
    the clipped ratio against their sampling-time probabilities), step 3 samples anew; against the plain-PyTorch
    loop in float32 and float64. And the same run stopped after step 1 (inside the rollout) and resumed, against
    the uninterrupted one."""
    # Adam's eps at 1e-6: its first steps divide each gradient by its own size, so a coordinate whose gradient is
    # float32 cancellation (~1e-8) moves by a share of the lr that rounding decides; eps bounds that share at
    # lr * error / eps, under the float32 bound below, while the step's real gradients (1e-4 and up) pass unchanged.
    training = replace(TRAINING, eps=1e-6, on_policy=replace(TRAINING.on_policy, updates_per_rollout=2))
    loss = {"name": "policy_gradient", "teacher": 0.0, "reward": 1.0}
    data = prompt_batches(2 * GAS, PROMPTS, seed=6)
    torch.manual_seed(0)
    run = distiller(out, loss, replace(training, checkpoint_dir=str(out / "stale_whole")))
    history = run.train(data)
    ours = gathered(run.student_model)
    ref32, ref64 = (plain_grpo(student_folder(out), run.made, dtype, reuse=2, training=training)
                    for dtype in (torch.float32, torch.float64))
    torch.manual_seed(0)
    first = distiller(out, loss, replace(training, checkpoint_dir=str(out / "stale_parts"), save_every=1))
    first.train(data, until=1)
    torch.manual_seed(123)
    second = distiller(out, loss, replace(training, checkpoint_dir=str(out / "stale_parts")))
    second.resume()
    second.train(data)
    start = [p.detach().float() for p in AutoModelForCausalLM.from_pretrained(student_folder(out)).parameters()]
    write(out, "stale", {
        "max_param_diff": max_diff(ours, ref32), "ours_vs_float64": max_diff(ours, ref64),
        "ref_vs_float64": max_diff(ref32, ref64), "max_param_change": max_diff(ours, start),
        "rollouts_sampled": len(run.made) // GAS, "reward_means": [h["reward_mean"] for h in history],
        "resumed_identical": all(torch.equal(a, b) for a, b in zip(ours, gathered(second.student_model),
                                                                   strict=True)),
        "resumed_history": second.history == history})


def resume(out: Path) -> None:
    """OPD advantage + reward, groups of 4, stopped after step 2 and resumed, against the uninterrupted run."""
    loss = [{"name": "reverse_kl", "weight": 0.5}, {"name": "policy_gradient", "weight": 1.0, "reward": 1.0}]
    training = replace(TRAINING, max_steps=4, save_every=2)
    data = prompt_batches(4 * GAS, PROMPTS, seed=3)
    torch.manual_seed(0)
    whole = distiller(out, loss, replace(training, checkpoint_dir=str(out / "whole")))
    whole_history = whole.train(data)
    torch.manual_seed(0)
    first = distiller(out, loss, replace(training, checkpoint_dir=str(out / "parts")))
    first.train(data, until=2)
    torch.manual_seed(123)  # whatever the process did in between
    second = distiller(out, loss, replace(training, checkpoint_dir=str(out / "parts")))
    second.resume()
    second.train(data)
    write(out, "resume", {
        "identical_params": all(torch.equal(a, b) for a, b in zip(gathered(whole.student_model),
                                                                  gathered(second.student_model), strict=True)),
        "same_history": whole_history == second.history})


def reward_fails(out: Path) -> None:
    """The reward raises at step 3: the run stops with the prompt named after step 2's checkpoint; resumed with the
    reward working, it ends where the uninterrupted run ends."""
    loss = {"name": "policy_gradient", "teacher": 1.0, "reward": 1.0}
    training = replace(TRAINING, max_steps=4, save_every=1)
    data = prompt_batches(4 * GAS, PROMPTS, seed=4)
    torch.manual_seed(0)
    whole = distiller(out, loss, replace(training, checkpoint_dir=str(out / "whole_fail")))
    whole.train(data)
    per_step = GAS * PROMPTS * GROUP  # reward calls a step
    CALLS[0], FAIL_AT[:] = 0, [2 * per_step + 3]  # the third step's micro-batch 0, its 3rd sample
    torch.manual_seed(0)
    failing = distiller(out, loss, replace(training, checkpoint_dir=str(out / "failing")))
    failing.train(data)
    stopped, step = failing.stopped_by, failing.step
    saved = sorted(p.name for p in (out / "failing").iterdir() if p.name.startswith("step_"))
    FAIL_AT.clear()
    torch.manual_seed(7)
    again = distiller(out, loss, replace(training, checkpoint_dir=str(out / "failing")))
    again.resume()
    again.train(data)
    write(out, "reward_fails", {
        "stopped_by": stopped, "step": step, "saved": saved, "resumed_to": again.step,
        "identical_params": all(torch.equal(a, b) for a, b in zip(gathered(whole.student_model),
                                                                  gathered(again.student_model), strict=True))})


def fails_on_one_rank(out: Path) -> None:
    """Two ranks; the reward raises on rank 1 only, at step 3: both ranks stop there (rank 0 told by the agreed flag,
    not left waiting in the step's collectives), after step 2's checkpoint."""
    training = replace(TRAINING, max_steps=4, save_every=1, checkpoint_dir=str(out / "one_rank_fails"))
    CALLS[0] = 0
    FAIL_AT[:] = [2 * GAS * PROMPTS * GROUP + 1] if distributed.rank() == 1 else []
    run = distiller(out, {"name": "policy_gradient", "teacher": 1.0, "reward": 1.0}, training)
    run.train(prompt_batches(4 * GAS, PROMPTS, seed=5 + distributed.rank()))
    FAIL_AT.clear()
    write(out, "fails_on_one_rank", {"stopped_by": run.stopped_by, "step": run.step,
                                     "error": type(run.stop_error).__name__})


def main() -> None:
    out, scenarios = Path(sys.argv[1]), sys.argv[2].split(",")
    distributed.init()
    for name in scenarios:
        globals()[name](out)


if __name__ == "__main__":
    main()
