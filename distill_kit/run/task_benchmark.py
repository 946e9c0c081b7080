"""A task benchmark: recipes of post-training distillation compared on what the student gets right.

Every recipe starts from the same initial student (the run's first ``students`` entry) and takes the same
``training.max_steps`` steps of ``training.micro_batch_size`` rows, each as its own :class:`Distiller` run::

    teacher                 the frozen teacher itself (the ceiling)
    sft                     cross-entropy on the labelled answers (no teacher: the baseline)
    seq_kd                  cross-entropy on the teacher's samples of the unlabelled prompts (sequence-level KD)
    on_policy_forward_kl    SFT warm start, then forward KL on the student's own samples of the prompts (GKD)
    forward_kl              forward KL to the teacher on the labelled answers (off-policy KD)      } only when named
    on_policy_reverse_kl    the on-policy recipe with reverse KL                                   } in task.recipes
    on_policy_jsd           the same with generalized JSD, beta 0.5                                }
    mixed                   reverse KL, rows half labelled answers, half student samples of prompts (fraction 0.5)
    self_distill            the student its own teacher (kind self, frozen initial weights) reading the labelled
                            answer in its prompt, forward KL on its own samples of the labelled prompts (SDFT)
    grpo                    SFT warm start, then the task's checker as the reward, task.samples_per_prompt samples
                            of each prompt, group-normalised advantages: no teacher (plain GRPO)
    opd                     the same samples, the teacher's per-token advantage log p_T - log p_S (on-policy
                            distillation through the sampled token), no reward
    opd_reward              both advantages in one objective (MOPD / OPD-RL)
    fixed_advantage         the control: a fixed negative advantage on every sampled token, no teacher, no reward

The last four sample the same rows per step as the other on-policy recipes (micro_batch_size of them: groups of
``task.samples_per_prompt``); the report's ``teacher_helps`` says, per seed, whether ``opd`` beat
``fixed_advantage`` and whether ``opd_reward`` beat the better of ``opd`` and ``grpo`` (docs/rewards.md).

Each is scored by greedy exact-match accuracy on held-out prompts (the task's checker, the ``exact_match``
metric) and the teacher-student KL on the held-out reference answers; the table gives the share of the
SFT-to-teacher accuracy gap each recipe closes and its wall time (warm start included). The whole comparison runs
once per seed of ``task.seeds`` (as ``training.seed``: the data drawn, the initial student, the batch order and
the sampling); the table gives each recipe's mean over the seeds, its range and every seed's value, because one
draw past the task's learning transition says little (docs/tasks.md).

With ``eval.harness.tasks`` (e.g. ``[distill_kit_arithmetic]``), lm-evaluation-harness also scores each seed's
students (and the teacher row's teacher) on that seed's held-out prompts, the checker's, and each row gets the
harness's metrics beside the checker's (``harness_exact_match``; :func:`score_with_harness`), over the seeds alike.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill_kit.config import HarnessConfig, RewardsConfig, RewardSpec, StudentSpec, TeacherSpec, build
from distill_kit.data import chat
from distill_kit.data.blocks import DataConfig
from distill_kit.data.privileged import PrivilegedTemplate
from distill_kit.distiller import Distiller
from distill_kit.engines import distributed
from distill_kit.errors import ConfigError
from distill_kit.run import run_config
from distill_kit.run.run_config import RunConfig, to_dict
from distill_kit.tasks import arithmetic, harness, sorting
from distill_kit.tasks.evaluate import accuracy, checked_answers
from distill_kit.training import evaluation
from distill_kit.training.on_policy import OnPolicyConfig
from distill_kit.training.plan import DataFacts

logger = logging.getLogger(__name__)

TASKS = {"arithmetic": arithmetic, "sorting": sorting}
"""The tasks a benchmark runs (``task.name``): each module's examples, seeds, checker and teacher folder."""
REWARD_RECIPES = {"grpo": {"teacher": 0.0, "reward": 1.0}, "opd": {"teacher": 1.0, "reward": 0.0},
                  "opd_reward": {"teacher": 1.0, "reward": 1.0},
                  "fixed_advantage": {"teacher": 0.0, "reward": 0.0, "fixed": -1.0}}
"""The recipes with rewards: each a ``policy_gradient`` loss (``losses/policy.py``) with these weights, the task's
checker the reward. The fixed advantage's size does not matter under Adam (the update's scale is normalised), only
its sign: every sampled token is pushed down alike."""


class Mixed:
    """Micro-batches of half answered rows, half prompts: one micro-batch of each loader, rows side by side."""

    def __init__(self, answered: chat.ChatLoader, prompts: chat.ChatLoader, pad_id: int):
        self.answered, self.prompts, self.pad_id = answered, prompts, pad_id

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for a, p in zip(self.answered, self.prompts, strict=False):
            rows = [(ids[m.bool()].tolist(), lab[m.bool()].tolist()) for part in (a, p)
                    for ids, lab, m in zip(part["input_ids"], part["labels"], part["attention_mask"], strict=True)]
            yield chat.pad_rows([r[0] for r in rows], [r[1] for r in rows], self.pad_id)


def chat_split(tokenizer, train: Path, heldout: Path, privileged: PrivilegedTemplate | None = None) -> chat.ChatSplits:
    """The task's JSONL records tokenised by the chat data pipeline (the teacher's template, answers counted);
    ``privileged``: with a self-teacher's prompts (``data/privileged.py``)."""
    return chat.build_splits(DataConfig(train=str(train), heldout=str(heldout), format="chat", block_size=128),
                             tokenizer, privileged=privileged)


SELF_TEMPLATE = PrivilegedTemplate("{completion}")
"""self_distill's privileged prompt: the question replaced by its worked answer (which begins with the question's
numbers). The whole answer, not the question and the answer: the teacher's row (prompt + the student's answer) then
stays within the student's 64 positions."""
SELF_TEACHER = TeacherSpec(name="self", kind="self", options={"mode": "initial", "privileged": SELF_TEMPLATE})
"""The frozen warm-started student (TRL SDFT's default teacher, ``base``): the only weights that learned to read the
answer from the prompt; the student's own, trained on plain prompts only, drift away from that (``ema``/``live``)."""


def run(config: RunConfig, prepare_student: Callable[..., StudentSpec], tokenizer: str,
        resume: bool = False) -> dict[str, Any]:
    """Every recipe in ``config.task.recipes`` at every seed in ``config.task.seeds``; writes
    ``<output_dir>/report.json`` and returns its summary: per recipe the mean over the seeds, the range and each
    seed's value (:func:`aggregate`), and each seed's own table.

    ``prepare_student`` is the CLI's (``run/cli.py``): the student the run config describes, built or cut from the
    teacher as a training run would (passed in, so the CLI and this module do not import each other). ``tokenizer``:
    the run's, as its plan decided it (``training/plan.py``: ``run_tokenizer``)."""
    task, began = config.task, time.perf_counter()
    if resume:
        raise ConfigError("--resume does not apply to a task benchmark (task.name): its recipes are short; rerun it")
    if distributed.world_size() != 1:
        raise ConfigError("the task benchmark runs on one process (its recipes are sized for a CPU); "
                          "run it with plain python")
    out = Path(config.output_dir)
    if not (Path(config.teacher) / "config.json").is_file():
        raise ConfigError(f"teacher: {config.teacher!r} is not a saved model directory; the {task.name} task's is "
                          f"distill_kit/assets/{task.name}/teacher (scripts/train_task_teacher.py writes it)")
    grouped = [name for name in task.recipes if name in REWARD_RECIPES]
    if grouped and config.training.micro_batch_size % task.samples_per_prompt:
        raise ConfigError(f"task.samples_per_prompt={task.samples_per_prompt} does not divide "
                          f"training.micro_batch_size={config.training.micro_batch_size}, and {grouped} sample whole "
                          "groups of each prompt: give a micro_batch_size that is a multiple of it")
    if (out / "report.json").exists():
        raise ConfigError(f"{out} already holds a report.json; give a new --output_dir")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    per_seed = []
    for seed in task.seeds:  # each seed is a whole run of its own: training.seed drives its data, init and sampling
        started = time.perf_counter()
        seeded = dataclasses.replace(config, output_dir=str(out / f"seed_{seed}"),
                                     training=dataclasses.replace(config.training, seed=seed))
        rows = run_seed(seeded, prepare_student, tokenizer)
        scores = score_with_harness(seeded, rows)
        per_seed.append({"seed": seed, "rows": table(rows)["rows"], "seconds": time.perf_counter() - started}
                        | ({"harness": scores} if scores is not None else {}))
        logger.info("seed %d done in %.0fs", seed, per_seed[-1]["seconds"])
    summary = aggregate(per_seed)
    summary["teacher_helps"] = teacher_helps(per_seed)
    summary["seconds"] = time.perf_counter() - began  # the whole comparison: data, every recipe, evaluation
    summary["config"] = to_dict(config)
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    print(format_table(summary["rows"], summary["seeds"]))
    print(f"whole comparison ({len(task.seeds)} seed(s)): {summary['seconds']:.0f} s; report: {out / 'report.json'}")
    return summary


def run_seed(config: RunConfig, prepare_student: Callable[..., StudentSpec], tokenizer) -> list[dict[str, Any]]:
    """One seed's rows: data drawn, student initialised and batches shuffled from ``config.training.seed``; the
    run's files go under ``config.output_dir``."""
    task, out = config.task, Path(config.output_dir)
    init = prepare_student(config.students[0], config, tokenizer).model
    module = TASKS[task.name]
    seeds = module.split_seeds(config.training.seed)
    labelled = list(module.examples(seeds["labelled"], task.labelled))
    prompts = list(module.examples(seeds["prompts"], task.prompts))
    heldout = list(module.examples(seeds["heldout"], task.heldout))
    files = {name: arithmetic.write_jsonl(out / "data" / f"{name}.jsonl", items, with_answers=name != "prompts")
             for name, items in (("labelled", labelled), ("prompts", prompts), ("heldout", heldout))}
    answered = chat_split(tokenizer, files["labelled"], files["heldout"])
    unanswered = chat_split(tokenizer, files["prompts"], files["heldout"]).train
    pad, mbs, seed = chat.pad_id_of(tokenizer), config.training.micro_batch_size, config.training.seed
    heldout_batches = chat.ChatLoader(answered.heldout, 100, pad_id=pad, shuffle=False, drop_last=False)
    data = {"labelled": lambda: chat.ChatLoader(answered.train, mbs, pad_id=pad, seed=seed),
            "prompts": lambda: chat.ChatLoader(unanswered, mbs, pad_id=pad, seed=seed),
            "prompt_groups": lambda: chat.ChatLoader(unanswered, mbs // task.samples_per_prompt, pad_id=pad, seed=seed),
            "mixed": lambda: Mixed(chat.ChatLoader(answered.train, mbs - mbs // 2, pad_id=pad, seed=seed),
                                   chat.ChatLoader(unanswered, mbs // 2, pad_id=pad, seed=seed), pad)}
    if "self_distill" in task.recipes:  # the labelled answers as the self-teacher's privileged prompts
        own = chat_split(tokenizer, files["labelled"], files["heldout"], privileged=SELF_TEMPLATE)
        both = datasets.concatenate_datasets([answered.train, chat_split(
            tokenizer, arithmetic.write_jsonl(out / "data" / "labelled_privileged.jsonl", [
                dataclasses.replace(item, prompt=item.answer) for item in labelled], with_answers=True),
            files["heldout"]).train])
        data |= {"labelled_privileged": lambda: chat.ChatLoader(own.train, mbs, pad_id=pad, seed=seed),
                 "labelled_both": lambda: chat.ChatLoader(both, mbs, pad_id=pad, seed=seed)}
    sampling = dataclasses.replace(config.training.on_policy, max_new_tokens=task.max_new_tokens,
                                   eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)

    def train(name: str, start: str, loss: Any, batches: str, steps: int, on_policy: OnPolicyConfig | None = None):
        training = dataclasses.replace(config.training, max_steps=steps, checkpoint_dir=None,
                                       on_policy=on_policy or OnPolicyConfig())
        if name in REWARD_RECIPES:
            training = dataclasses.replace(training, lr=task.policy_lr,
                                           rewards=RewardsConfig(functions=(RewardSpec(name=task.name),)))
        teachers = {"teachers": [SELF_TEACHER]} if name == "self_distill" else {"teacher": config.teacher}
        distiller = Distiller(start, **teachers, loss=loss, training=training, tokenizer=config.tokenizer or
                              config.teacher, deepspeed=run_config.deepspeed_settings(config),
                              data=DataFacts(kind="chat"))
        distiller.train(data[batches]())
        return distiller

    def answer_kl(name: str, distiller: Distiller) -> float:
        """Mean KL from the task's teacher to the student on the held-out answers; a self-taught student's is taken
        against the task's teacher too (its own teacher is itself), outside the Distiller."""
        if name != "self_distill":
            return distiller.evaluate(heldout_batches)["student"]["mean_kl"]
        external = AutoModelForCausalLM.from_pretrained(config.teacher).eval().to(distiller.device)
        student = distiller.student_model

        def forward(model):
            return lambda batch: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        was_training = student.training
        student.eval()
        try:
            with torch.no_grad():
                figures = evaluation.evaluate_students({"student": forward(student)}, forward(external),
                                                       heldout_batches, distiller.device)
        finally:
            student.train(was_training)
        return figures["student"]["mean_kl"]

    def check(name: str, model: torch.nn.Module) -> float:
        """The checker's exact match on the held-out prompts; each answer and verdict go to ``answers/<name>.jsonl``
        (``doc_id`` as in the harness's samples, for comparing them example by example)."""
        checked = checked_answers(model, tokenizer, heldout, task.max_new_tokens, module.check)
        (out / "answers").mkdir(parents=True, exist_ok=True)
        (out / "answers" / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in checked))
        return accuracy(checked)

    def score(name: str, distiller: Distiller, seconds: float) -> dict[str, Any]:
        started = time.perf_counter()
        row = {"recipe": name, "exact_match": check(name, distiller.student_model),
               "answer_kl": answer_kl(name, distiller), "train_seconds": seconds}
        logger.info("%s: %s (evaluated in %.1fs)", name, row, time.perf_counter() - started)
        return row

    steps, warm = config.training.max_steps, min(task.warm_start_steps, config.training.max_steps)
    on_policy = dataclasses.replace(sampling, fraction=1.0, sampler="student")
    grouped = dataclasses.replace(on_policy, samples_per_prompt=task.samples_per_prompt)
    recipes = {
        "sft": lambda: ("cross_entropy", "labelled", None, 0),
        "forward_kl": lambda: ("forward_kl", "labelled", None, 0),
        "seq_kd": lambda: ("cross_entropy", "prompts", dataclasses.replace(sampling, fraction=1.0, sampler="teacher"),
                           0),
        "on_policy_reverse_kl": lambda: ("reverse_kl", "prompts", on_policy, warm),
        "on_policy_jsd": lambda: ({"name": "generalized_jsd", "beta": 0.5}, "prompts", on_policy, warm),
        "on_policy_forward_kl": lambda: ("forward_kl", "prompts", on_policy, warm),
        "mixed": lambda: ("reverse_kl", "mixed", dataclasses.replace(on_policy, fraction=0.5), 0),
        "self_distill": lambda: ("forward_kl", "labelled_privileged", on_policy, warm),
    } | {name: (lambda weights=weights: ({"name": "policy_gradient", **weights}, "prompt_groups", grouped, warm))
         for name, weights in policy_weights(task).items()}
    rows: list[dict[str, Any]] = []
    warm_start: tuple[str, float] | None = None
    for name in task.recipes:
        if name == "teacher":
            started = time.perf_counter()
            teacher = AutoModelForCausalLM.from_pretrained(config.teacher)
            rows.append({"recipe": "teacher", "exact_match": check("teacher", teacher),
                         "answer_kl": 0.0, "train_seconds": 0.0, "eval_seconds": time.perf_counter() - started})
            continue
        loss, batches, sampler, warm_steps = recipes[name]()
        start, seconds = init, 0.0
        if warm_steps and name == "self_distill":  # its own: the answers also read from the prompt (SELF_TEMPLATE)
            started = time.perf_counter()
            sft = train("warm_start_self", init, "cross_entropy", "labelled_both", warm_steps)
            sft.student_model.save_pretrained(out / "init" / "warm_start_self")
            start, seconds = str(out / "init" / "warm_start_self"), time.perf_counter() - started
        elif warm_steps:
            if warm_start is None:  # one warm start, shared by the on-policy recipes; its time is charged to each
                started = time.perf_counter()
                sft = train("warm_start", init, "cross_entropy", "labelled", warm_steps)
                path = out / "init" / "warm_start"
                sft.student_model.save_pretrained(path)
                warm_start = (str(path), time.perf_counter() - started)
            start, seconds = warm_start
        started = time.perf_counter()
        distiller = train(name, start, loss, batches, steps - warm_steps, sampler)
        rows.append(score(name, distiller, seconds + time.perf_counter() - started))
        distiller.student_model.save_pretrained(out / "students" / name)  # to read its answers afterwards
    return rows


def policy_weights(task: Any) -> dict[str, dict[str, float]]:
    """Each reward recipe's ``policy_gradient`` weights: :data:`REWARD_RECIPES`, opd_reward's reward at
    ``task.reward_weight``."""
    return REWARD_RECIPES | {"opd_reward": REWARD_RECIPES["opd_reward"] | {"reward": task.reward_weight}}


def score_with_harness(config: RunConfig, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``eval.harness`` on one seed's folder (``config.output_dir``): each saved student, and the teacher when the
    teacher row ran and ``eval.harness.teacher`` is on, on the held-out prompts drawn at ``training.seed``,
    ``task.heldout`` of them: the checker's. Each row gets the harness's metrics (:func:`harness_column`); returns
    the harness's scores (report.json's ``per_seed[i].harness``), None when there is nothing to score."""
    settings, task = config.eval.harness, config.task
    teacher = settings.teacher and "teacher" in task.recipes
    if not settings.tasks or not (teacher or any(name != "teacher" for name in task.recipes)):
        return None
    seeded = dataclasses.replace(settings, seed=config.training.seed, examples=task.heldout)
    scores = harness.evaluate_run(config.output_dir, seeded, teacher=teacher, run_config=to_dict(config))
    values = harness.summarize(scores)["models"]  # {model: {"<task> <metric>": value}}; the teacher is "teacher"
    for row in rows:
        row |= {harness_column(task.name, key): value for key, value in values.get(row["recipe"], {}).items()}
    return scores


HARNESS = "harness_"
"""What a row's harness columns begin with."""


def is_task_report(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a finished task benchmark (its report.json has the per-seed tables)."""
    path = Path(run_dir) / "report.json"
    return path.is_file() and "per_seed" in json.loads(path.read_text())


def rescore_with_harness(run_dir: str | Path, settings: HarnessConfig) -> dict[str, Any]:
    """``settings`` on a finished task benchmark (``scripts/evaluate_run.py``): each seed's saved students, on that
    seed's held-out prompts as the run itself would have scored them (:func:`score_with_harness`), the rows'
    harness columns replaced, report.json rewritten; returns its new summary. Settings a task run refuses
    (``seed``, ``examples``, ``limit``) are refused here by the same check (``RunConfig``'s), and the harness's own
    checks run before the first seed's evaluation; report.json is written once, at the end."""
    run_dir = Path(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    saved = build(RunConfig, report["config"])
    config = dataclasses.replace(saved, eval=dataclasses.replace(saved.eval, harness=settings))
    for entry in report["per_seed"]:
        seeded = dataclasses.replace(config, output_dir=str(run_dir / f"seed_{entry['seed']}"),
                                     training=dataclasses.replace(config.training, seed=entry["seed"]))
        entry["rows"] = [{k: v for k, v in row.items() if not k.startswith(HARNESS)} for row in entry["rows"]]
        entry["harness"] = score_with_harness(seeded, entry["rows"])
    summary = aggregate(report["per_seed"]) | {k: report[k] for k in ("seconds", "config") if k in report}
    (run_dir / "report.json").write_text(json.dumps(summary, indent=2))
    return summary


def harness_column(task: str | None, key: str) -> str:
    """A row's key for a harness metric (``harness.summarize``'s ``"<task> <metric>"``): ``harness_exact_match``
    for the benchmark's own task's exact match (the checker's prompts and checker, through the harness),
    ``harness_<task>_<metric>`` for any other."""
    return f"{HARNESS}exact_match" if key == f"distill_kit_{task} exact_match" else HARNESS + key.replace(" ", "_")


def table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows with the share of the SFT-to-teacher accuracy gap each closes (when both were run)."""
    accuracy = {row["recipe"]: row["exact_match"] for row in rows}
    if "sft" in accuracy and "teacher" in accuracy and accuracy["teacher"] > accuracy["sft"]:
        for row in rows:
            row["gap_closed"] = (row["exact_match"] - accuracy["sft"]) / (accuracy["teacher"] - accuracy["sft"])
    best = max((r for r in rows if r["recipe"] not in ("teacher", "sft")), key=lambda r: r["exact_match"],
               default=None)
    return {"rows": rows, "best": best["recipe"] if best else None}


def teacher_helps(per_seed: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Whether the teacher helped, per seed (None when the recipes to compare did not all run): ``opd`` above the
    ``fixed_advantage`` control (its teacher did more than push every sampled token down), and ``opd_reward`` at or
    above the better of ``opd`` and ``grpo`` (the teacher and the reward together beat either alone); each a list of
    booleans in the order of the seeds, with ``all`` over them."""
    def at(entry: dict[str, Any], name: str) -> float | None:
        return next((row["exact_match"] for row in entry["rows"] if row["recipe"] == name), None)

    verdicts: dict[str, Any] = {}
    comparisons = {"opd_over_fixed_advantage": (("opd",), ("fixed_advantage",), False),
                   "opd_reward_over_best_of_opd_grpo": (("opd_reward",), ("opd", "grpo"), True)}
    for key, (mine, others, ties) in comparisons.items():
        values = [([at(e, n) for n in mine], [at(e, n) for n in others]) for e in per_seed]
        if any(v is None for a, b in values for v in a + b):
            continue
        per = [a[0] >= max(b) if ties else a[0] > max(b) for a, b in values]
        verdicts[key] = {"per_seed": per, "all": all(per)}
    return verdicts or None


def over_seeds(name: str, values: list[float]) -> dict[str, Any]:
    """One metric over the seeds: its mean (``name``), range (``name_min``, ``name_max``) and every seed's value
    (``name_per_seed``): how every quality figure of the task benchmarks is reported."""
    return {name: sum(values) / len(values), f"{name}_min": min(values), f"{name}_max": max(values),
            f"{name}_per_seed": values}


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Each recipe over the seeds: its mean exact match, the range (``exact_match_min``/``_max``) and every seed's
    value (``exact_match_per_seed``, in the order of ``seeds``), and so each harness column every seed has
    (``harness_exact_match``...); mean answer KL and train seconds; the gap closed from the mean accuracies
    (:func:`table`), with each seed's own gap closed beside it. ``per_seed`` keeps each seed's table as run."""
    seeds = [entry["seed"] for entry in per_seed]
    names = [row["recipe"] for row in per_seed[0]["rows"]]
    rows = []
    for name in names:
        found = [next(r for r in entry["rows"] if r["recipe"] == name) for entry in per_seed]
        row = {"recipe": name, **over_seeds("exact_match", [r["exact_match"] for r in found]),
               "answer_kl": sum(r["answer_kl"] for r in found) / len(found),
               "train_seconds": sum(r["train_seconds"] for r in found) / len(found)}
        for key in [k for k in found[0] if k.startswith(HARNESS) and all(k in r for r in found)]:
            row |= over_seeds(key, [r[key] for r in found])
        if all("gap_closed" in r for r in found):
            row["gap_closed_per_seed"] = [r["gap_closed"] for r in found]
        rows.append(row)
    summary = table(rows)
    return {"seeds": seeds, "rows": summary["rows"], "best": summary["best"], "per_seed": per_seed}


def format_table(rows: list[dict[str, Any]], seeds: list[int] | None = None) -> str:
    """The printed table: mean exact match over the seeds, its range and each seed's value when there are several;
    then each harness column (``harness`` for ``harness_exact_match``), its mean and each seed's value."""
    several = seeds is not None and len(seeds) > 1
    head = f"{'recipe':<22}{'exact match':>12}"
    if several:
        head += f"{'range':>15}  {'seeds ' + ','.join(map(str, seeds)):<24}"
    columns = list(dict.fromkeys(k for row in rows for k in row if k.startswith(HARNESS) and f"{k}_per_seed" in row))
    cells = {key: [_harness_cell(row, key, several) for row in rows] for key in columns}
    labels = {key: "harness" if key == f"{HARNESS}exact_match" else key.removeprefix(HARNESS) for key in columns}
    widths = {key: max(len(labels[key]), *map(len, cells[key])) + 2 for key in columns}
    head += "".join(f"{labels[key]:>{widths[key]}}" for key in columns)
    lines = [head + f"{'gap closed':>12}{'answer KL':>11}{'seconds':>9}"]
    for i, row in enumerate(rows):
        gap = f"{row['gap_closed']:.0%}" if "gap_closed" in row else "-"
        line = f"{row['recipe']:<22}{row['exact_match']:>12.1%}"
        if several:
            spread = f"{row['exact_match_min']:.1%}-{row['exact_match_max']:.1%}"
            values = " ".join(f"{v:.1%}" for v in row["exact_match_per_seed"])
            line += f"{spread:>15}  {values:<24}"
        line += "".join(f"{cells[key][i]:>{widths[key]}}" for key in columns)
        lines.append(line + f"{gap:>12}{row['answer_kl']:>11.4f}{row['train_seconds']:>9.0f}")
    return "\n".join(lines)


def _harness_cell(row: dict[str, Any], key: str, several: bool) -> str:
    """One harness column's mean, then each seed's value when there are several; '-' for a row the harness did not
    score (the teacher row with eval.harness.teacher off)."""
    if key not in row:
        return "-"
    shown = ".1%" if "exact_match" in key or "acc" in key else ".4g"  # shares as percentages, as the checker's
    values = [row[key], *(row[f"{key}_per_seed"] if several else [])]
    return (f"{values[0]:{shown}}" + ("  " + " ".join(f"{v:{shown}}" for v in values[1:]) if several else ""))
