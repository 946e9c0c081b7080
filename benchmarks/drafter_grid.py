"""Drafters for a teacher, the embedded default's or the arithmetic task's: tau at gamma = 4 of one size and one
initialisation, by objective.

``--task default`` (the default): the embedded default's 6.7M teacher; every model-drafter is the embedded
default's student (0.94M parameters), cut from its teacher as ``make distill`` cuts it (``DEFAULT_STUDENT_CUT``:
every other layer, width pruned by activation importance), the same cut weights for every objective of a seed. Rows
of the corpus are ``prompt`` tokens of context and ``continuation`` tokens to learn: the off-policy objectives learn
the corpus's continuation, the on-policy ones replace it by the drafter's own sample (``training.on_policy``:
fraction 1, sampler student, temperature 1).

``--task arithmetic``: the arithmetic task's teacher (``distill_kit/assets/arithmetic/teacher``, 0.86M parameters,
19 tokens). Its recipes train a student of their own shape from random weights (``configs/arithmetic.yaml``:
3 layers, 96 wide, 3 heads, 288 MLP neurons, 0.36M parameters); a drafter of one size and one initialisation is
that shape cut from the teacher as ``DEFAULT_STUDENT_CUT`` cuts the default's (``ARITHMETIC_STUDENT_CUT``: the
width by activation importance; the depth every other layer, 0 and 2, as ``every: 2`` keeps, and the last, 3, for
the recipe's three layers of the teacher's four): a random student's acceptance would measure how far training gets
from nothing rather than the objective. Rows are the task's worked answers (its labelled stream, seed 0's as
``quality_sampled.py`` draws it, ``--train-blocks`` of them), each one conversation as the chat template renders
it, the answer and its end token counted (the prompt not); on-policy rows sample the answer to the question, up to
``--continuation`` tokens or the end token. The held-out prompts are ``--prompts`` questions of the task's held-out
stream (``<|user|>`` question ``<|assistant|>``), decoded until the end token (the answer, at most
``--new-tokens``). The optimiser is the task's (``configs/arithmetic.yaml``: 64 rows a step, betas 0.9/0.98, cosine
schedule); ``--prompt`` is not read. The feature drafter reads the inputs of the teacher's layers 2, 2 and 1 (the
EAGLE-3 default clamped to its four layers, ``students/feature_drafter.py``).

Rows (``ROWS``), for either task:

* ``cut``: the cut, not trained;
* ``no_teacher``, ``forward_kl`` (today's recipe), ``total_variation``: off-policy, ``--steps`` steps, one run (one
  teacher forward for the three);
* ``teacher_text_ce``, ``teacher_text_fkl``, ``teacher_text_tv`` (default task): the same three losses, from the same
  cut, on the teacher's greedy text: each training row's prompt continued by the teacher's ``--continuation``
  greedy tokens (``on_teacher_text``), the text greedy speculative decoding drafts in (cross-entropy there is
  sequence-level KD);
* warm-started from that seed's ``forward_kl`` drafter, ``--warm-steps`` more steps each (as the task benchmark
  warm-starts its on-policy recipes): ``forward_kl_continued`` (off-policy, the control: as many steps in all as the
  on-policy rows), ``on_policy_fkl``, ``on_policy_tv``, ``target_verified`` (total variation weighted toward the
  drafts the teacher rejects, ``losses/drafting.py``) and ``target_verified_fkl`` (the same weights on forward KL);
* ``feature_drafter``: EAGLE-3's feature-reading drafter on the teacher (``students/feature_drafter.py``, reading
  ``--feature-layers``), trained ``--steps`` steps with forward KL on the corpus at ``--ttt`` unrolled draft steps
  (training-time test), each step's loss weighted ``0.8 ** (m - 1)`` as EAGLE-3 does (and as the Distiller's step
  does with ``feature_drafter.ttt_steps``, tested there); a plain loop here (AdamW without weight decay, the runs'
  schedule and clipping), kept so that the figures recorded with it stay reproducible;
  ``feature_drafter_teacher_text``: the same on the teacher's greedy text.

Every model drafter is the task's cut unless ``--cut`` changes its size (fields of ``FromTeacherConfig``).
``--sharpness`` measures instead how decided the teacher is on its own greedy text (top-1 probability, gap to the
second), which bounds how often any drafter's argmax can be its argmax.

Each drafter is measured by exact greedy speculative decoding with the teacher as target (``--sampled``: sampled
mode too, temperature 1) on ``--prompts`` held-out prompts (default: the first ``prompt`` tokens of held-out blocks,
``--new-tokens`` tokens each; arithmetic: held-out questions, to the end token; ``distill_kit/training/
speculative.py``).

Cells (a seed's off-policy run, its teacher's-text run, each feature drafter, each warm-started row) run as
``--jobs`` processes side by side (``OMP_NUM_THREADS=1`` each; on ``--device cuda`` all on the one GPU); a
warm-started cell starts when its seed's off-policy cell is done. Each cell writes
``<out>/cells/<row>_s<seed>.json`` when done, and the merge (``<out>/drafters.json``, mean over seeds and range)
reads whatever cells are there, so a grid stopped early keeps its finished cells::

    python benchmarks/drafter_grid.py --seeds 0 1 2 --steps 400 --warm-steps 200 --jobs 5 --out runs/drafters
    python benchmarks/drafter_grid.py --merge --out runs/drafters        # the table of the cells there
    python benchmarks/drafter_grid.py --task arithmetic --seeds 0 1 2 --jobs 2 --out runs/drafters_arithmetic
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import losses.functional as functional  # noqa: E402
from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig  # noqa: E402
from distill_kit.config import FromTeacherConfig, OnPolicyConfig  # noqa: E402
from distill_kit.data import blocks, chat  # noqa: E402
from distill_kit.data.corpus import write_corpus  # noqa: E402
from distill_kit.engines.schedule import scheduler  # noqa: E402
from distill_kit.run.run_config import DEFAULT_STUDENT_CUT, DEFAULT_TEACHER  # noqa: E402
from distill_kit.run.task_benchmark import chat_split  # noqa: E402
from distill_kit.students.feature_drafter import FeatureDrafter  # noqa: E402
from distill_kit.students.from_teacher import student_from_teacher  # noqa: E402
from distill_kit.tasks import arithmetic  # noqa: E402
from distill_kit.training import speculative  # noqa: E402
from distill_kit.training.plan import DataFacts  # noqa: E402
from distill_kit.training.student import TTT_DECAY  # noqa: E402

OFF_POLICY = {"no_teacher": "cross_entropy", "forward_kl": "forward_kl", "total_variation": "total_variation"}
WARM = {"on_policy_fkl": ("forward_kl", True),
        "target_verified_fkl": ({"name": "target_verified", "gamma": 4, "rejected_weight": 1.0,
                                 "divergence": "forward_kl"}, True),
        "forward_kl_continued": ("forward_kl", False), "on_policy_tv": ("total_variation", True),
        "target_verified": ({"name": "target_verified", "gamma": 4, "rejected_weight": 1.0}, True)}
TEACHER_TEXT = {"teacher_text_ce": "cross_entropy", "teacher_text_fkl": "forward_kl",
                "teacher_text_tv": "total_variation"}  # the same losses on the teacher's greedy text
FEATURE = ["feature_drafter", "feature_drafter_teacher_text"]
ROWS = ["cut", *OFF_POLICY, *TEACHER_TEXT, *WARM, *FEATURE]
CELLS = ["off_policy", "teacher_text", *WARM, *FEATURE]  # a cell: one process's work for one seed
TRAINED_FROM_THE_CUT = {"off_policy": OFF_POLICY, "teacher_text": TEACHER_TEXT}  # cells of several rows: their rows


@dataclass
class Rows:
    """A task's data as a cell uses it."""

    batches: Callable[[int], Iterator[dict]]
    """Endless training micro-batches in an order fixed by the seed, labels on what is learnt (or sampled)."""
    calibration: Iterable
    """Micro-batches in order: the cut's activation importance is measured on them."""
    prompts: list[torch.Tensor]
    """Held-out prompts (1-D ids) tau is measured on."""
    eos_token_id: int | None = None
    """Where decoding stops and on-policy samples end; None: ``--new-tokens`` tokens, and the model's end token."""
    split: object = None
    """The training rows themselves (the default task's blocks), which the teacher's-text rows regenerate."""


def default_rows(args: argparse.Namespace, tokenizer) -> Rows:
    """The stdlib corpus in blocks of ``--prompt`` + ``--continuation`` tokens; prompts: held-out blocks' first
    ``--prompt`` tokens."""
    splits = write_corpus(Path(args.cache) / "corpus")
    config = blocks.DataConfig(train=str(splits.train), heldout=str(splits.heldout),
                               block_size=args.prompt + args.continuation, max_train_blocks=args.train_blocks,
                               max_heldout_blocks=max(args.prompts, 8))
    split = blocks.build_splits(config, tokenizer)

    def batches(seed: int):
        loader = blocks.BlockLoader(split.train, args.batch, rank=0, world_size=1, seed=seed)
        while True:
            yield from with_prompts(loader, args.prompt)
    return Rows(batches, blocks.BlockLoader(split.train, args.batch, rank=0, world_size=1, shuffle=False),
                [torch.tensor(row["input_ids"][:args.prompt]) for row in list(split.heldout)[:args.prompts]],
                split=split)


def arithmetic_files(args: argparse.Namespace) -> list[Path]:
    """``--train-blocks`` worked answers of the task's labelled stream and ``--prompts`` of its held-out stream
    (seed 0's streams), as chat records; each file written once (cells started side by side read it)."""
    seeds, paths = arithmetic.split_seeds(0), []
    for name, seed, count in (("train", seeds["labelled"], args.train_blocks), ("heldout", seeds["heldout"],
                                                                               args.prompts)):
        path = Path(args.cache) / "drafters_arithmetic" / f"{name}_{count}.jsonl"
        if not path.exists():
            arithmetic.write_jsonl(path.with_suffix(".partial"), list(arithmetic.examples(seed, count)),
                                   with_answers=True).replace(path)
        paths.append(path)
    return paths


def arithmetic_rows(args: argparse.Namespace, tokenizer) -> Rows:
    """The task's conversations through its chat template (``run/task_benchmark.py``: ``chat_split``), labels on the
    answer and its end token; prompts: held-out conversations up to the answer (a conversation's length less its
    counted tokens)."""
    split, pad = chat_split(tokenizer, *arithmetic_files(args)), chat.pad_id_of(tokenizer)

    def batches(seed: int):
        loader = chat.ChatLoader(split.train, args.batch, pad_id=pad, seed=seed)
        while True:
            yield from loader
    return Rows(batches, chat.ChatLoader(split.train, args.batch, pad_id=pad, shuffle=False),
                [torch.tensor(row["input_ids"][:row["length"] - row["counted"]]) for row in split.heldout],
                tokenizer.eos_token_id)


@dataclass(frozen=True)
class Task:
    """A teacher the grid drafts for: its weights, the cut every model drafter starts from, its data, and what it
    sets of the training and of the flags left out of the command."""

    teacher: Path
    cut: FromTeacherConfig
    rows: Callable[[argparse.Namespace, object], Rows]
    write: Callable[[argparse.Namespace], object]
    """Its text on disk, written once before the cells read it side by side."""
    kind: str = "text"
    training: dict = field(default_factory=dict)
    defaults: dict = field(default_factory=dict)


ARITHMETIC_TEACHER = ROOT / "distill_kit" / "assets" / "arithmetic" / "teacher"
ARITHMETIC_STUDENT = yaml.safe_load((ROOT / "configs" / "arithmetic.yaml").read_text())["students"][0]["init"]
ARITHMETIC_STUDENT_CUT = FromTeacherConfig(
    layers=(0, 2, 3), **{k: ARITHMETIC_STUDENT[k] for k in ("hidden_size", "intermediate_size",
                                                            "num_attention_heads", "num_key_value_heads")})
"""The arithmetic recipes' student shape (``configs/arithmetic.yaml``), cut from the task's teacher (module doc)."""
TASKS = {
    "default": Task(DEFAULT_TEACHER, DEFAULT_STUDENT_CUT, default_rows,
                    lambda args: write_corpus(Path(args.cache) / "corpus"), training={"betas": (0.9, 0.95)},
                    defaults={"batch": 8, "continuation": 64, "train_blocks": 2048}),
    "arithmetic": Task(ARITHMETIC_TEACHER, ARITHMETIC_STUDENT_CUT, arithmetic_rows, arithmetic_files, kind="chat",
                       training={"betas": (0.9, 0.98), "lr_schedule": "cosine"},
                       defaults={"batch": 64, "continuation": 32, "train_blocks": 20000})}


def with_prompts(loader, prompt: int):
    """Each row's first ``prompt`` tokens as its prompt (labels -100): the losses count the continuation only, and
    the on-policy sampler answers the prompt."""
    for batch in loader:
        batch = dict(batch)
        batch["labels"] = batch["labels"].clone()
        batch["labels"][:, :prompt] = -100
        yield batch


def training_config(args: argparse.Namespace, seed: int, steps: int, on_policy: bool,
                    eos_token_id: int | None = None) -> TrainingConfig:
    return TrainingConfig(max_steps=steps, micro_batch_size=args.batch, lr=args.lr, warmup_steps=20, seed=seed,
                          log_every=10**9, **TASKS[args.task].training,
                          on_policy=OnPolicyConfig(fraction=1.0, sampler="student", max_new_tokens=args.continuation,
                                                   eos_token_id=eos_token_id)
                          if on_policy else OnPolicyConfig())


def train(students: dict, losses: dict, args: argparse.Namespace, rows: Rows, seed: int, steps: int,
          on_policy: bool) -> dict:
    task = TASKS[args.task]
    specs = [StudentSpec(name=name, model=students[name], loss=losses[name]) for name in losses]
    distiller = Distiller(students=specs, teachers=[TeacherSpec(name="teacher", model=str(task.teacher))],
                          training=training_config(args, seed, steps, on_policy, rows.eos_token_id),
                          data=DataFacts(kind=task.kind))
    torch.manual_seed(seed)
    distiller.train(rows.batches(seed))
    return {name: distiller.students[name].model for name in losses}


@torch.no_grad()
def on_teacher_text(rows: Rows, teacher, args: argparse.Namespace, device: torch.device) -> Rows:
    """``rows`` with each training row's continuation replaced by the teacher's greedy continuation of its prompt
    (``--prompt`` tokens, then ``--continuation`` greedy tokens, labels on those): the text greedy speculative
    decoding drafts in, as EAGLE-3 and Medusa regenerate their training data with the target. Greedy decoding is
    deterministic, so the text is computed once here, in batches (the KV cache of ``generate``), and equals what the
    Distiller's teacher sampler at temperature 0 (``on_policy: {sampler: teacher, temperature: 0}``) writes row by
    row, a ZeRO-3 generate step at every token (too slow for this grid). Default task only: the arithmetic
    teacher's greedy answer is the data's worked answer (it answers every question right)."""
    if args.task != "default":
        raise SystemExit("the teacher's-text rows are for --task default (the arithmetic data is the teacher's text)")
    loader = blocks.BlockLoader(rows.split.train, 256, rank=0, world_size=1, shuffle=False, drop_last=False)
    texts = []
    for batch in loader:
        prompts = batch["input_ids"][:, :args.prompt].to(device)
        texts += teacher.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                  max_new_tokens=args.continuation, min_new_tokens=args.continuation,
                                  eos_token_id=None, pad_token_id=0).cpu().tolist()
    texts = texts[:len(rows.split.train)]  # the last batch's filler blocks (all labels -100) are not rows
    split = datasets.Dataset.from_list([{"input_ids": ids, "attention_mask": [1] * len(ids),
                                         "labels": [-100] * args.prompt + ids[args.prompt:]}
                                        for ids in texts])

    def batches(seed: int):
        loader = blocks.BlockLoader(split, args.batch, rank=0, world_size=1, seed=seed)
        while True:
            yield from loader
    return Rows(batches, rows.calibration, rows.prompts, rows.eos_token_id, split)


def train_feature_drafter(teacher, args: argparse.Namespace, rows: Rows, seed: int, device: torch.device):
    """EAGLE-3's drafter on ``teacher``: forward KL to the teacher's next-token distribution at every learnt
    position, at each of ``--ttt`` unrolled draft steps (step m weighted ``TTT_DECAY ** (m - 1)``, 0.8, summed, as
    in the Distiller's step), AdamW on its own weights (the teacher's embedding and head stay frozen), the
    Distiller's schedule and clipping."""
    torch.manual_seed(seed)
    drafter = FeatureDrafter(teacher, layers=args.feature_layers).to(device).train()
    training = training_config(args, seed, args.steps, False)
    optimizer = torch.optim.AdamW(drafter.trainable_parameters(), lr=args.lr, betas=training.betas, weight_decay=0.0)
    schedule = scheduler(optimizer, training)
    batches = rows.batches(seed)
    for _ in range(args.steps):
        batch = next(batches)
        ids = batch["input_ids"].to(device)
        mask = (batch["labels"][:, 1:] != -100).to(device)  # positions whose next token is learnt
        with torch.no_grad():
            out = teacher(input_ids=ids, output_hidden_states=True)
        loss = 0.0
        for m, step in enumerate(drafter.unrolled(ids, out.hidden_states, steps=args.ttt)):
            per_token = functional.forward_kl(step.logits[:, :-1].float(), out.logits[:, :-1].float())
            loss = loss + TTT_DECAY ** m * (per_token * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), training.max_grad_norm)
        optimizer.step()
        schedule.step()
    return drafter.eval()


def measure(teacher, drafters: dict, prompts: list[torch.Tensor], args: argparse.Namespace,
            eos_token_id: int | None = None) -> dict:
    """Greedy figures of each drafter, and with ``--sampled`` its sampled-mode tau and acceptance beside them;
    ``eos_token_id``: each prompt decoded up to the end token (or ``--new-tokens``)."""
    figures = speculative.evaluate_drafters(teacher, drafters, prompts, gamma=args.gamma,
                                            max_new_tokens=args.new_tokens, mode="greedy", latency_repeats=3,
                                            eos_token_id=eos_token_id)
    if args.sampled:
        sampled = speculative.evaluate_drafters(teacher, drafters, prompts, gamma=args.gamma,
                                                max_new_tokens=args.new_tokens, mode="sampled", latency_repeats=1,
                                                eos_token_id=eos_token_id)
        for name, row in sampled.items():
            figures[name] |= {"tau_sampled": row["tau"],
                              "acceptance_by_position_sampled": row["acceptance_by_position"]}
    return figures


def run_cell(cell: str, seed: int, args: argparse.Namespace) -> dict:
    """One cell's rows, trained and measured."""
    device, task = torch.device(args.device), TASKS[args.task]
    tokenizer = AutoTokenizer.from_pretrained(task.teacher)
    rows = task.rows(args, tokenizer)
    teacher = AutoModelForCausalLM.from_pretrained(task.teacher, dtype=torch.float32).eval()
    prompts = [prompt.to(device) for prompt in rows.prompts]
    work = Path(args.out) / "work"
    torch.manual_seed(seed)
    if cell in FEATURE:
        teacher = teacher.to(device)
        if cell == "feature_drafter_teacher_text":
            rows = on_teacher_text(rows, teacher, args, device)
        drafter = train_feature_drafter(teacher, args, rows, seed, device)
        return measure(teacher, {cell: drafter}, prompts, args, rows.eos_token_id)
    cut = student_from_teacher(teacher, dataclasses.replace(task.cut, **args.cut), rows.calibration)
    if cell in TRAINED_FROM_THE_CUT:  # the cell's rows from the cut, --steps steps, one teacher forward for them
        if cell == "teacher_text":
            rows = on_teacher_text(rows, teacher.to(device), args, device)
        losses = {n: loss for n, loss in TRAINED_FROM_THE_CUT[cell].items() if n in args.rows}
        trained = train({name: copy.deepcopy(cut) for name in losses}, losses, args, rows, seed, args.steps, False)
        if "forward_kl" in trained:  # the warm start of this seed's warm cells (a state dict: loaded weights-only)
            work.mkdir(parents=True, exist_ok=True)
            torch.save({k: v.detach().cpu() for k, v in trained["forward_kl"].state_dict().items()},
                       work / f"forward_kl_s{seed}.pt")
        drafters = {"cut": cut} | trained if cell == "off_policy" and "cut" in args.rows else trained
        return measure(teacher.to(device), {n: m.to(device).eval() for n, m in drafters.items()}, prompts, args,
                       rows.eos_token_id)
    loss, on_policy = WARM[cell]
    cut.load_state_dict(torch.load(work / f"forward_kl_s{seed}.pt", weights_only=True))
    trained = train({cell: cut}, {cell: loss}, args, rows, seed, args.warm_steps, on_policy)
    return measure(teacher.to(device), {n: m.to(device).eval() for n, m in trained.items()}, prompts, args,
                   rows.eos_token_id)


@torch.no_grad()
def teacher_sharpness(args: argparse.Namespace) -> dict:
    """How decided the teacher is where greedy speculative decoding drafts: over its greedy text after each
    held-out prompt (``--new-tokens`` tokens), its top-1 probability and the gap to its second. A greedy draft is
    kept when the drafter's argmax is the teacher's; where the teacher's top two are close, a drafter near the
    teacher's distribution still picks the other one about as often."""
    task = TASKS[args.task]
    rows = task.rows(args, AutoTokenizer.from_pretrained(task.teacher))
    teacher = AutoModelForCausalLM.from_pretrained(task.teacher, dtype=torch.float32).eval()
    top1, gap = [], []
    for prompt in rows.prompts:
        text = speculative.target_greedy_text(teacher, prompt, args.new_tokens, teacher.config.vocab_size)
        top = teacher(input_ids=text[None]).logits[0, len(prompt) - 1:-1].float().softmax(-1).topk(2, -1).values
        top1 += top[:, 0].tolist()
        gap += (top[:, 0] - top[:, 1]).tolist()
    p1, margin = torch.tensor(top1), torch.tensor(gap)
    return {"positions": len(top1), "top1_mean": p1.mean().item(), "top1_median": p1.median().item(),
            "share_top1_below_0.5": (p1 < 0.5).float().mean().item(),
            "share_top1_below_0.3": (p1 < 0.3).float().mean().item(),
            "share_gap_below_0.1": (margin < 0.1).float().mean().item(), "gap_mean": margin.mean().item()}


def cell_path(out: Path, cell: str, seed: int) -> Path:
    return out / "cells" / f"{cell}_s{seed}.json"


def schedule_cells(args: argparse.Namespace, argv: list[str]) -> None:
    """Every (cell, seed) as its own process, ``--jobs`` at a time; a warm cell after its seed's off-policy one."""
    wanted = [c for c in CELLS if set(TRAINED_FROM_THE_CUT.get(c, [c])) & set(args.rows)]
    # the first cells of every seed first, then each warm row at every seed before the next row
    pending = [(c, s) for c in wanted if c not in WARM for s in args.seeds]
    pending += [(c, s) for c in wanted if c in WARM for s in args.seeds]
    TASKS[args.task].write(args)  # once, before the cells read it side by side
    running: dict = {}
    done: set = set()
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    started = time.time()
    while pending or running:
        if args.deadline and time.time() - started > args.deadline:
            for key, process in running.items():  # the merge keeps every cell finished so far
                process.terminate()
                process.wait()
                print(f"cell {key[0]} seed {key[1]}: stopped at the deadline", flush=True)
            print(f"not started: {pending}", flush=True)
            return
        for key, process in list(running.items()):
            if process.poll() is not None:
                del running[key]
                done.add(key)
                print(f"cell {key[0]} seed {key[1]}: exit {process.returncode}", flush=True)
        ready = [(c, s) for c, s in pending if c not in WARM or ("off_policy", s) in done]
        for key in ready[:max(0, args.jobs - len(running))]:
            pending.remove(key)
            command = [sys.executable, __file__, *argv, "--cell", key[0], str(key[1])]
            running[key] = subprocess.Popen(command, env=env)
        time.sleep(1)


def cut_field(text: str) -> tuple[str, object]:
    """``FIELD=VALUE`` of ``--cut``: a FromTeacherConfig field, the value as YAML reads it (``layers=[0,2,4]``)."""
    name, _, value = text.partition("=")
    if name not in {f.name for f in dataclasses.fields(FromTeacherConfig)} or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: give FIELD=VALUE with FIELD one of "
                                         f"{', '.join(f.name for f in dataclasses.fields(FromTeacherConfig))}")
    value = yaml.safe_load(value)
    return name, tuple(value) if isinstance(value, list) else value


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="default", help="whose teacher the drafters draft for")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS)
    parser.add_argument("--steps", type=int, default=400, help="off-policy and feature-drafter steps")
    parser.add_argument("--warm-steps", type=int, default=200, help="steps of each warm-started row")
    parser.add_argument("--ttt", type=int, default=3, help="the feature drafter's unrolled draft steps in training")
    parser.add_argument("--feature-layers", type=int, nargs=3, metavar=("LOW", "MIDDLE", "HIGH"),
                        help="the teacher's hidden states the feature drafter reads (default: EAGLE-3's)")
    parser.add_argument("--cut", nargs="+", default=[], metavar="FIELD=VALUE", type=cut_field,
                        help="the model drafters' size, fields of the task's cut replaced (FromTeacherConfig), e.g. "
                             "every=2 hidden_size=256 intermediate_size=704 num_attention_heads=4 "
                             "num_key_value_heads=4 (the default's teacher width at half its depth)")
    parser.add_argument("--batch", type=int, help="rows a step (default 8; arithmetic 64)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--prompt", type=int, default=32, help="context tokens of each row and held-out prompt")
    parser.add_argument("--continuation", type=int,
                        help="tokens learnt (or sampled) after the prompt (default 64; arithmetic: at most 32 sampled)")
    parser.add_argument("--train-blocks", type=int, help="training blocks (default 2048; arithmetic: 20000 answers)")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts tau is measured on")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per held-out prompt")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--sampled", action="store_true", help="sampled-mode tau too (temperature 1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--jobs", type=int, default=1, help="cells run as this many processes side by side")
    parser.add_argument("--deadline", type=float, default=0,
                        help="seconds after which running cells are stopped and the finished ones merged (0: none)")
    parser.add_argument("--cache", default=".cache")
    parser.add_argument("--out", default="runs/drafters")
    parser.add_argument("--cell", nargs=2, metavar=("CELL", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--merge", action="store_true", help="only merge the cells in --out and print the table")
    parser.add_argument("--sharpness", action="store_true",
                        help="only measure how decided the teacher is on its greedy text (<out>/sharpness.json)")
    args = parser.parse_args(argv)
    args.cut = dict(args.cut)
    for name, value in TASKS[args.task].defaults.items():  # the task's value of each flag left out
        if getattr(args, name) is None:
            setattr(args, name, value)
    out = Path(args.out)
    if args.cell:
        torch.set_num_threads(1)
        cell, seed = args.cell[0], int(args.cell[1])
        started = time.time()
        figures = run_cell(cell, seed, args)
        path = cell_path(out, cell, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cell": cell, "seed": seed, "seconds": time.time() - started,
                                    "figures": figures}, indent=2))
        print(f"{cell} seed {seed} ({time.time() - started:.0f} s): " +
              ", ".join(f"{k} {v['tau']:.3f}" for k, v in figures.items()), flush=True)
        return 0
    if args.sharpness:
        out.mkdir(parents=True, exist_ok=True)
        figures = teacher_sharpness(args)
        (out / "sharpness.json").write_text(json.dumps(figures, indent=2))
        print(json.dumps(figures, indent=2))
        return 0
    if not args.merge:
        schedule_cells(args, argv)
    merged = merge(out, vars(args))
    (out / "drafters.json").write_text(json.dumps(merged, indent=2))
    print(json.dumps(merged["table"], indent=2))
    return 0


def merge(out: Path, settings: dict) -> dict:
    """Every finished cell's rows by seed, and the table."""
    seeds: dict = {}
    for path in sorted((out / "cells").glob("*.json")):
        cell = json.loads(path.read_text())
        seeds.setdefault(str(cell["seed"]), {}).update(cell["figures"])
        seeds[str(cell["seed"])].setdefault("seconds", {})[cell["cell"]] = cell["seconds"]
    results = {"settings": settings, "seeds": seeds}
    results["table"] = table(results)
    return results


def _mean_positions(rows: list[list]) -> list:
    return [statistics.mean(a for a in x if a is not None) if any(a is not None for a in x) else None
            for x in zip(*rows, strict=True)]


def table(results: dict) -> dict:
    """Per drafter: mean tau over seeds, its range, each seed's, the ratio of the mean to forward KL's; the same
    for sampled-mode tau where measured."""
    rows: dict = {}
    names = {k for figures in results["seeds"].values() for k, v in figures.items() if isinstance(v, dict)
             and "tau" in v}
    for name in sorted(names, key=lambda n: ROWS.index(n) if n in ROWS else len(ROWS)):
        found = [f[name] for f in results["seeds"].values() if name in f]
        taus = [f["tau"] for f in found]
        rows[name] = {"tau_mean": statistics.mean(taus), "tau_min": min(taus), "tau_max": max(taus), "taus": taus,
                      "acceptance_by_position_mean": _mean_positions([f["acceptance_by_position"] for f in found])}
        sampled = [f["tau_sampled"] for f in found if "tau_sampled" in f]
        if sampled:
            rows[name] |= {"tau_sampled_mean": statistics.mean(sampled), "tau_sampled_min": min(sampled),
                           "tau_sampled_max": max(sampled), "taus_sampled": sampled}
    if "forward_kl" in rows:
        for row in rows.values():
            row["vs_forward_kl"] = row["tau_mean"] / rows["forward_kl"]["tau_mean"]
            if "tau_sampled_mean" in row and "tau_sampled_mean" in rows["forward_kl"]:
                row["sampled_vs_forward_kl"] = row["tau_sampled_mean"] / rows["forward_kl"]["tau_sampled_mean"]
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
