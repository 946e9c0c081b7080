"""``python scripts/distill.py`` / ``distill-kit``: config -> data -> engines -> train -> export -> report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from distill_kit.config import StudentSpec, import_subclass
from distill_kit.data import blocks, chat
from distill_kit.data.corpus import write_corpus
from distill_kit.distiller import Distiller
from distill_kit.engines import deepspeed_config, distributed, models, quantize
from distill_kit.engines.deepspeed_config import DeepSpeedConfigError
from distill_kit.errors import CheckpointError, ConfigError, StepFault
from distill_kit.run import output_dir, report, run_config, student_tokenizer, task_benchmark, validate
from distill_kit.run.log import RunLog
from distill_kit.run.run_config import STDLIB_CORPUS, RunConfig
from distill_kit.students import from_teacher
from distill_kit.tasks import harness
from distill_kit.teachers import self_teacher, served
from distill_kit.training import checkpoint, rewarding
from distill_kit.training.plan import DataFacts, Plan, checkpoint_folder, student_init

logger = logging.getLogger("distill_kit")


def _on_main_first(work):
    """Run ``work`` on rank 0, then on the others: one-time preparation is written once, then reused."""
    result = work() if distributed.is_main() else None
    distributed.barrier()
    return result if distributed.is_main() else work()


def prepare_data(config: RunConfig) -> blocks.DataConfig:
    """Resolve ``data.train: stdlib`` to this Python's standard library, written once into the cache."""
    if config.data.train != STDLIB_CORPUS:
        return config.data
    splits = _on_main_first(lambda: write_corpus(Path(config.cache_dir) / "corpus"))
    return dataclasses.replace(config.data, train=str(splits.train), heldout=str(splits.heldout))


def calibration_loader(train_loader):
    """The training data as one unshuffled rank reads it: the same first micro-batches on every rank."""
    extra = {"pad_id": train_loader.pad_id} if hasattr(train_loader, "pad_id") else {}  # chat data
    return type(train_loader)(train_loader.dataset, train_loader.micro_batch_size, rank=0, world_size=1,
                              shuffle=False, drop_last=False, **extra)


def cut_students(config: RunConfig, plan: Plan, train_loader) -> dict[str, nn.Module]:
    """The students built from the teacher's own weights (``init_from_teacher``) not built yet, by name, on every
    rank (a resume reuses those in ``<output_dir>/init``).

    ``validate`` checks every choice first (``check_cuts``), before any work. The teacher then loads once as the run
    loads it (ZeRO-3 shards under the teacher's DeepSpeed config: never whole on one rank) and is dropped before
    the engines are built; every rank measures importance on the same first training micro-batches.
    """
    if all(s.init_from_teacher is None for s in config.students):
        return {}
    built = distributed.broadcast_object([s.name for s in config.students
                                          if (Path(config.output_dir) / "init" / s.name / "config.json").is_file()])
    wanted = {s.name: s.init_from_teacher for s in config.students
              if s.init_from_teacher is not None and s.name not in built}
    if not wanted:
        return {}
    lead = next(spec for spec in plan.teachers if spec.name == plan.lead)  # the plan's lead: the one cut from
    ds_config = plan.teacher_ds_configs[lead.name]  # the lead teacher's, as the run will build it
    teacher = models.load(lead.model, ds_config, config.training.dtype, config=plan.cards[lead.name].config)
    device = distributed.init()
    if deepspeed_config.zero_stage(ds_config) != 3:
        teacher.to(device)  # a replicated teacher: whole on every rank, as the run will hold it
    calibration = calibration_loader(train_loader)
    return {name: from_teacher.student_from_teacher(teacher, cut, calibration, device) for name, cut in wanted.items()}


def prepare_student(student: StudentSpec, config: RunConfig, tokenizer: PreTrainedTokenizerBase,
                    cut: nn.Module | None = None, plan: Plan | None = None) -> StudentSpec:
    """The student's spec. Its model is the given directory (its tokenizer checked at start-up against the run's, or
    the students' own with ``student_tokenizer``), or a fresh one built from the teacher's config
    with ``init`` overrides (checked by ``validate``; and the students' vocabulary), or ``cut`` (built from the
    teacher's weights), saved so that it loads like any pretrained model: under its own ZeRO layout, and
    identically for every run that shares the seed. It is written once (into a temporary folder, then renamed):
    a resume reuses it."""
    if student.model is not None:  # its tokenizer was checked at start-up (validate.check_student_tokenizers)
        return student
    path = Path(config.output_dir) / "init" / student.name
    if distributed.is_main() and not (path / "config.json").is_file():
        if plan is not None:  # the plan's config of it: the lead teacher's with init (read once, by the plan)
            model_config = plan.student_configs[student.name]
        else:  # across tokenizers (no plan before the vocabulary map) and the task benchmark's recipes
            model_config = AutoConfig.from_pretrained(config.teacher)
            if config.student_tokenizer is not None:  # the students' own vocabulary, unless init says otherwise
                model_config.update({"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                                     "bos_token_id": tokenizer.bos_token_id or tokenizer.eos_token_id,
                                     "pad_token_id": tokenizer.pad_token_id})
            model_config.update(student_init(student, model_config))
        partial = path.with_name(checkpoint.PARTIAL + path.name)
        shutil.rmtree(partial, ignore_errors=True)
        (cut if cut is not None else models.fresh_student(model_config, config.training.seed)).save_pretrained(partial)
        partial.replace(path)
    distributed.barrier()
    return dataclasses.replace(student, model=str(path), init={}, init_from_teacher=None)


# Settings that may change when a run is resumed; everything else must match the run in output_dir.
RESUMABLE_CHANGES = ("eval", "cache_dir", "output_dir", "report_to", "training.max_steps", "training.log_every",
                     "training.save_every", "training.keep_checkpoints", "training.checkpoint_dir")


def run_identity(config: RunConfig) -> dict[str, Any]:
    identity = run_config.to_dict(config)
    for dotted in RESUMABLE_CHANGES:
        *parents, leaf = dotted.split(".")
        node = identity
        for part in parents:
            node = node[part]
        node.pop(leaf, None)
    # A served teacher is its weights, not its address: the checkpoint's teacher sha256 (the server's weights')
    # decides whether a resume continues, so the same weights served on another host or port may resume; and how
    # its requests travel (timeout_s, retries_s, ...) changes nothing trained on, so it may change across a resume.
    if served.is_url(identity.get("teacher")):
        identity["teacher"] = "served"
    for entry in identity.get("teachers") or ():
        if isinstance(entry, dict) and served.is_url(entry.get("model")):
            entry["model"] = "served"
            if isinstance(entry.get("options"), dict):
                entry["options"] = {k: v for k, v in entry["options"].items() if k not in served.TRANSPORT_OPTIONS}
    return identity


def with_output_dir(config: RunConfig, resume: bool) -> RunConfig:
    """Fix the output folder (a new dated one by default; rank 0 picks it); the plan puts checkpoints in it."""
    output_dir = config.output_dir
    if output_dir is None:
        if resume:
            raise ConfigError("--resume needs the run's folder: --output_dir runs/<the run>")
        output_dir = distributed.broadcast_object(time.strftime("runs/%Y%m%d-%H%M%S"))
    return dataclasses.replace(config, output_dir=output_dir)


def build_loaders(config: RunConfig, data_config: blocks.DataConfig, tokenizer: PreTrainedTokenizerBase,
                  data: DataFacts, tokenize=None, rewards: Sequence[Any] = ()):
    """This rank's training and held-out loaders: text blocks, or chat conversations (``data.format``).
    ``tokenize``: how text becomes blocks when it is not :func:`blocks.tokenize_to_blocks` (paired blocks).
    ``rewards``: the plan's; records keep the fields they ask for, which every training record must have."""
    rank, world = distributed.rank(), distributed.world_size()
    mbs, seed = config.training.micro_batch_size, config.training.seed
    if data.kind == "chat":
        if tokenize is not None:
            raise ConfigError("student_tokenizer works with text data only: chat data across tokenizers (a "
                              "template per tokenizer, aligned answers) is not supported yet")
        route = [t.name for t in config.teachers] if config.combine == "route" and config.teachers else None
        # every rank renders the same records: no cache to share; a self-teacher's privileged prompts with them
        keep = any(reward.fields for reward in rewards)
        splits = chat.build_splits(data_config, tokenizer, route=route is not None,
                                   privileged=self_teacher.template_of(config.teachers or ()), keep_fields=keep)
        if keep:
            rewarding.check_fields(rewards, splits.stats["train"].fields, f"data.train ({data_config.train})")
        if distributed.is_main():
            for name, stats in splits.stats.items():
                stats.log(name, data_config.block_size)
        # Evaluation scores the reference answers (a split of prompts only would report perplexity 1 and KL 0 over
        # no token); training needs them unless every row is answered by a sample (fraction 1).
        chat.require_answers(splits, "the held-out evaluation's figures", ["heldout"])
        if config.training.on_policy.fraction < 1:
            chat.require_answers(splits, "the students' losses", ["train"])
        pad = chat.pad_id_of(tokenizer)
        packing = {"packing": data_config.packing is True, "block_size": data_config.block_size}
        samples = config.training.on_policy.fraction > 0  # the sampler reads unpacked rows, then packs (pack_to)
        prompts = mbs // config.training.on_policy.samples_per_prompt  # each sampled G times: mbs rows trained on
        loaders = (chat.ChatLoader(splits.train, prompts, pad_id=pad, rank=rank, world_size=world, seed=seed,
                                   route=route, **packing | ({"packing": False} if samples else {})),
                   chat.ChatLoader(splits.heldout, mbs, pad_id=pad, rank=rank, world_size=world, shuffle=False,
                                   drop_last=False, route=route, **packing))
        if packing["packing"] and distributed.is_main():
            for name, loader in zip(("train", "heldout"), loaders, strict=True):
                logger.info(loader.describe_packing(name))
        return loaders
    splits = _on_main_first(lambda: blocks.build_splits(data_config, tokenizer, tokenize))
    heldout = splits.heldout
    if data_config.streaming:  # train from the stream; its held-out split (max_heldout_blocks) is read into memory
        train = blocks.StreamingBlockLoader(splits.train, mbs, rank=rank, world_size=world, seed=seed)
        heldout = datasets.Dataset.from_list(list(heldout))
    else:
        train = blocks.BlockLoader(splits.train, mbs, rank=rank, world_size=world, seed=seed)
    return train, blocks.BlockLoader(heldout, mbs, rank=rank, world_size=world, shuffle=False, drop_last=False)


def distiller_class(config: RunConfig) -> type[Distiller]:
    """The class the run builds: ``distiller: pkg.module:Class`` (a :class:`Distiller` subclass, e.g. research code
    that overrides one hook), or :class:`Distiller` itself."""
    if config.distiller is None:
        return Distiller
    return import_subclass(config.distiller, Distiller, "distiller", "subclass it and override the hooks you need "
                           "(make_batch, teacher_forward, student_forward, compute_loss)")


def build_distiller(config: RunConfig, specs: list[StudentSpec], plan: Plan | None, data: DataFacts,
                    vocab_map: Any = None) -> Distiller:
    """Exactly what a Python user would write (the run's students and teachers, one Distiller or the run's subclass
    of it), built from the plan the start-up checks made."""
    return distiller_class(config)(
        students=specs, teachers=run_config.teacher_specs(config), combine=config.combine, training=config.training,
        deepspeed=run_config.deepspeed_settings(config), data=data, output_dir=config.output_dir,
        tokenizer=config.tokenizer, vocab_map=vocab_map, plan=plan,
        **({"speculative": config.eval.speculative} if plan is None else {}))  # else the plan carries it


def teacher_records(config: RunConfig, distiller: Distiller) -> list[dict[str, Any]]:
    """Every teacher as the report records it: name, source, weight and weights' sha256 (as the checkpoints do).
    A self-teacher has no model of its own (null); its identity (mode, template, initial weights) stands there."""
    identities = distiller.teachers.identities
    return [{"name": name, "model": spec.model if spec.model is None or isinstance(spec.model, str)
             else type(spec.model).__name__, "weight": spec.weight, "sha256": identities[name]}
            for name, spec in distiller.teachers.specs.items()]


def train_students(config: RunConfig, students: Distiller, train_loader, eval_loader, log: RunLog) -> bool:
    """Train to ``max_steps``, evaluating inside the loop every ``eval.every`` steps and after the last (a resumed
    run only where no evaluation was kept). False when SIGTERM/SIGINT stopped it (every rank saved first)."""
    students.on_record, students.on_evaluation = log.step, lambda result: log.evaluation(result["step"], {
        k: v for k, v in result.items() if k != "step"})
    students.train(train_loader, heldout=eval_loader, eval_every=config.eval.every,
                   eval_batches=config.eval.max_batches)
    return students.stopped_by is None


@contextmanager
def _input_errors(what: str) -> Iterator[None]:
    """Errors from reading the user's input (data, DeepSpeed configs) as ConfigErrors: a message, no traceback."""
    try:
        yield
    except (blocks.DataError, DeepSpeedConfigError, FileNotFoundError, KeyError) as err:
        raise ConfigError(f"{what}: {err.args[0] if isinstance(err, KeyError) and err.args else err}") from err


def run(config: RunConfig, resume: bool = False) -> dict[str, Any] | None:
    """The whole job; returns the report's summary on every rank (None when a signal stopped it). A teacher or a
    reward that failed mid-run (a server down too long, an answer that cannot be trained on, a reward that raised)
    raises its :class:`StepFault` after the checkpoint of the last whole step, its message saying how to continue.

    Every check that needs no work comes first (``validate.py``); the output folder is claimed (locked, then its
    ``run_identity.json`` written) only once the data is read too, so a run that fails to start leaves nothing
    that stops the same command, fixed, from running. The lock is held until the run returns or raises (or its
    process dies): a second start in the same folder meanwhile is refused (``output_dir.py``).
    """
    with contextlib.ExitStack() as held:
        return _run(config, resume, held)


def _on_main_or_refuse(work: Callable[[], None]) -> None:
    """``work`` on rank 0; its ``ConfigError`` raised on every rank alike (none is left waiting in a collective)."""
    problem = None
    if distributed.is_main():
        try:
            work()
        except ConfigError as err:
            problem = str(err)
    problem = distributed.broadcast_object(problem)
    if problem is not None:
        raise ConfigError(problem)


def _claim(out: Path, config: RunConfig, identity: dict[str, Any], resume: bool, held: contextlib.ExitStack) -> None:
    """Rank 0 locks the folder (``held`` releases it), checks it again under the lock (another start may have come
    between ``validate`` and now), records the identity and the data's fingerprint, and clears leftovers of killed
    saves: only under the lock, so never a live run's save in progress. Every rank raises the same error."""
    def claim() -> None:
        held.enter_context(output_dir.Lock(out))
        output_dir.check(out, identity, resume=resume, checkpoint_dir=config.training.checkpoint_dir)
        if not resume or not (out / output_dir.DATA_FINGERPRINT).is_file():
            output_dir.record_data(out, validate.data_fingerprint(config))
        checkpoint.remove_leftovers(config.training.checkpoint_dir)  # a full disk's leftovers go first

    _on_main_or_refuse(claim)


def _run(config: RunConfig, resume: bool, held: contextlib.ExitStack) -> dict[str, Any] | None:
    """The job in named phases: plan (every check, before any write), prepare data, claim the folder, build
    students, build the Distiller (teachers, then students' engines), train (evaluation inside the loop), report."""
    started = time.time()
    distributed.init()
    config = with_output_dir(config, resume)
    if config.task.name is not None:  # a task benchmark: its recipes in turn, one table
        return run_task(config, resume, held)
    out = Path(config.output_dir)
    distiller_class(config)  # importable and a Distiller, before any work
    identity, params = run_identity(config), run_config.to_dict(config)  # as given: teacher or teachers
    data = run_config.data_facts(config)  # "is this chat data?": decided here, once
    plan = validate.validate(config, resume, identity, data)  # the plan decides the lead teacher and the tokenizer
    checkpoints = plan.checkpoint_dir if plan is not None else checkpoint_folder(config.training, out)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, checkpoint_dir=checkpoints))
    with _input_errors("data"):
        data_config, tokenizer, own, train_loader, eval_loader = prepare_loaders(
            config, data, validate.tokenizer_of(config, plan), plan and plan.rewards)
    _claim(out, config, identity, resume, held)
    if distributed.is_main() and own is not None:
        own.save(out)
    distributed.barrier()
    specs = build_students(config, plan, tokenizer, train_loader)
    with _input_errors("DeepSpeed config"):
        students = build_distiller(config, specs, plan, data, own and own.vocab_map)
    if resume and students.resume() is None:  # validate found one; it went away since
        raise ConfigError(checkpoint.nothing_to_resume(checkpoints, []))
    log = RunLog(out, resumed_at=students.step if resume else None, report_to=config.report_to, params=params)
    finished = train_students(config, students, train_loader, eval_loader, log)
    log.close()
    if not finished:
        stopped = (f"stopped by {students.stopped_by} at step {students.step}; checkpoint saved. "
                   f"Continue with: --output_dir {out} --resume")
        if students.stop_error is not None:  # not a stop the user asked for: an error (the CLI exits 1)
            raise type(students.stop_error)(stopped) from students.stop_error
        if distributed.is_main():
            print(stopped)
        return None
    return write_report(config, students, out, tokenizer, params, log, data_config, started)


def run_task(config: RunConfig, resume: bool, held: contextlib.ExitStack) -> dict[str, Any]:
    """A task benchmark (``task.name``): its recipes in turn, one table (``run/task_benchmark.py``), its folder locked
    as a run's is."""
    # the task writes its own chat records, rows as long as its prompts and answers: no data.block_size to check
    plan = validate.validate(config, resume, run_identity(config), DataFacts(kind="chat"),
                             checks=validate.TASK_CHECKS)
    _on_main_or_refuse(lambda: held.enter_context(output_dir.Lock(Path(config.output_dir))))
    return task_benchmark.run(config, prepare_student, validate.tokenizer_of(config, plan), resume)


def prepare_loaders(config: RunConfig, data: DataFacts, tokenizer_source: str, rewards: Sequence[Any] = ()):
    """The data phase: the data files (the embedded corpus written once), the tokenizer (``tokenizer_source``, the
    run's as its plan decided it; the students' own across tokenizers), and this rank's training and held-out
    loaders (``rewards``: the plan's, whose record fields the chat records keep)."""
    data_config = prepare_data(config)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    own = student_tokenizer.prepare(config, data_config, tokenizer)  # None: the students share the teacher's
    if own is not None:
        tokenizer = own.tokenizer
    train_loader, eval_loader = build_loaders(config, data_config, tokenizer, data, own and own.tokenize, rewards)
    return data_config, tokenizer, own, train_loader, eval_loader


def build_students(config: RunConfig, plan: Plan | None, tokenizer: PreTrainedTokenizerBase,
                   train_loader) -> list[StudentSpec]:
    """The students phase: each student's model, given, built fresh from the plan's config, or cut from the teacher
    (saved under ``<output_dir>/init`` so that a resume reuses it)."""
    cut = cut_students(config, plan, train_loader) if plan is not None else {}
    return [prepare_student(s, config, tokenizer, cut.pop(s.name, None), plan) for s in config.students]


def write_report(config: RunConfig, students: Distiller, out: Path, tokenizer: Any, params: dict[str, Any],
                 log: RunLog, data_config: Any, started: float) -> dict[str, Any] | None:
    """The report phase: each student exported, ``report.json`` and its table; the summary on every rank."""
    students.export(out / "students", tokenizer)
    teachers = teacher_records(config, students)  # on every rank: a ZeRO-3 teacher's hash gathers its shards
    summary, quantized = None, {}
    if distributed.is_main():
        losses = {s.name: s.loss for s in config.students}
        histories = {s.name: [{"step": r["step"], "loss": r[f"{s.name}/loss"]}
                              | {k: r[f"{s.name}/{k}"] for k in report.REWARD_FIGURES if f"{s.name}/{k}" in r}
                              for r in students.history] for s in config.students}
        tokens = (config.training.micro_batch_size * config.training.gradient_accumulation_steps
                  * distributed.world_size() * data_config.block_size)
        extra = {"seconds": time.time() - started, "world_size": distributed.world_size(), "tokens_per_step": tokens,
                 # what each engine was given: the run's values, filled in or checked equal (deepspeed_config.py)
                 "deepspeed_configs": {"students": {name: s.ds_config for name, s in students.students.items()},
                                       "teachers": students.teachers.ds_configs},
                 "teachers": teachers}
        quantized = {s.name: quantize.export_record(out / "students" / s.name, s.quantize)
                     for s in config.students if s.quantize is not None}  # engines/quantize.py: size on disk
        extra |= {"quantized_exports": quantized} if quantized else {}
        inits = {s.name: "teacher" if s.init_from_teacher else "pretrained" if s.model else "random"
                 for s in config.students}
        summary = report.write(out, params, losses, histories, log.evaluations(), extra, inits)
    if config.eval.harness.tasks:  # lm-evaluation-harness on the exported models, on every rank (its prompts spread)
        distributed.barrier()  # report.json is written
        summary = harness.add_to_report(out, harness.evaluate_run(out, config.eval.harness)) or summary
    if distributed.is_main():
        print(report.table(summary))
        for name, record in quantized.items():
            print(f"{name}: {record['scheme']} export, {record['weight_bytes'] / 2**20:.1f} MiB of weights on disk "
                  f"({record['bf16_bytes'] / 2**20:.1f} MiB in bf16)")
        print(f"report: {out / 'report.json'}, curves: {out / 'loss_curves.png'}, students: {out / 'students'}")
    return distributed.broadcast_object(summary)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    args = [a for a in args if not a.startswith("--local_rank")]  # the deepspeed launcher's, read from env
    if "-h" in args or "--help" in args:
        print(run_config.help_text())
        return 0
    config_file, print_config = None, False
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise SystemExit("--config needs a file: --config path/to/run.yaml")
        config_file = args[i + 1]
        del args[i:i + 2]
    resume = "--resume" in args
    if resume:
        args.remove("--resume")
    if "--print-config" in args:
        args.remove("--print-config")
        print_config = True
    try:
        config = run_config.load(config_file, args)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    if print_config:
        print(run_config.dump(config))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        summary = run(config, resume=resume)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    except blocks.DataError as err:  # e.g. a stream with too few blocks, found once it is read
        raise SystemExit(f"data error: {err}") from None
    except CheckpointError as err:  # e.g. a disk that filled during a save: the cause, the space, the fix
        raise SystemExit(f"checkpoint error: {err}") from None
    except StepFault as err:  # a served teacher down or answering wrongly, a reward failing: checkpointed, resumable
        raise SystemExit(f"{err.label}: {err}") from None
    if summary is not None and distributed.is_main():
        print(json.dumps(summary["students"] if "students" in summary else summary["rows"], indent=2))
    distributed.shutdown()  # a process group left to the interpreter's exit can abort it (exit code 134)
    return 0 if summary is not None else STOPPED


STOPPED = 3
"""The exit status of a run a signal stopped (SIGTERM, SIGINT) after its checkpoint: not finished, so not 0, which a
scheduler would read as done; not 1, an error's; ``--resume`` continues it."""
