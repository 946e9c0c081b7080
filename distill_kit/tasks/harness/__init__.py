"""lm-evaluation-harness on a finished run: every exported student and, once, the teacher, scored by the harness's
own Hugging Face model class (``lm_eval.models.huggingface.HFLM``) through ``lm_eval.simple_evaluate``; the scores go
into ``report.json`` and the report's table.

Two calls::

    scores = evaluate_run(run_dir, HarnessConfig(tasks=("distill_kit_arithmetic",), limit=100))
    summary = add_to_report(run_dir, scores)      # report.json's "harness", the summary's table

The project's tasks (``distill_kit_arithmetic``, ``distill_kit_sorting``) are harness task configs next to this file
(YAML, ``dataset_path: json``): their seeded held-out prompts are written to ``<run_dir>/harness/data`` and scored
by each task's own exact checker (``checks.py``). Any other name (``gsm8k``, ``ifeval``, ``mmlu``) is the harness's
own task, on the same code path; with ``offline`` (the default) its data must already be in the Hugging Face cache.

Nothing in a run folder runs code: models load with ``trust_remote_code=False`` from ``*.safetensors`` only, and a
folder whose config asks for remote code (``auto_map``) or holds only pickled weights is refused before any work.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from distill_kit.config import HarnessConfig, TeacherSpec
from distill_kit.errors import ConfigError
from distill_kit.tasks import arithmetic, sorting
from distill_kit.teachers.kinds import kind_of

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
PROJECT_TASKS = {"distill_kit_arithmetic": arithmetic, "distill_kit_sorting": sorting}
"""The project's harness tasks (a YAML config here each) and the task module that draws their prompts."""
LM_EVAL = "lm-eval==0.4.13"
INSTALL = f"pip install 'distill-kit[eval]' (or {LM_EVAL})"


@dataclass(frozen=True)
class Model:
    """One model the harness scores: its folder, the tokenizer folder, and a LoRA adapter over a base."""

    name: str
    role: str  # "student" or "teacher"
    path: str
    tokenizer: str | None = None  # None: the model's own folder
    peft: str | None = None  # an adapter folder; ``path`` is then its base model


# ---- checks, all before any work ----------------------------------------------------------------------------------

def check(config: HarnessConfig) -> None:
    """lm-eval installed and every task name known, or one ConfigError naming the fix. Listing the harness's own
    tasks indexes its ~15,000 configs (about 7 s), so that happens only when a name is not the project's."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(f"eval.harness.tasks {list(config.tasks)} needs lm-evaluation-harness: {INSTALL}, "
                          "or set eval.harness.tasks to []") from None
    if not config.tasks:
        raise ConfigError("eval.harness.tasks is empty: name the tasks to score, e.g. [distill_kit_arithmetic], "
                          "[gsm8k]")
    others = [name for name in config.tasks if name not in PROJECT_TASKS]
    if others:  # a distill_kit_ name is the project's (the harness has none): no need to index the harness's
        known = set() if all(n.startswith("distill_kit_") for n in others) else set(_task_manager(others).all_tasks)
        unknown = [name for name in others if name not in known]
        if unknown:
            hints = "; ".join(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if (
                close := difflib.get_close_matches(name, [*PROJECT_TASKS, *known], n=1)) else "") for name in unknown)
            raise ConfigError(f"eval.harness.tasks: unknown task {hints}; give the project's "
                              f"{', '.join(PROJECT_TASKS)} or a task of lm-eval ('lm_eval ls tasks' lists them)")


def models(run_dir: str | Path, teacher: bool = True, run_config: dict[str, Any] | None = None) -> list[Model]:
    """The run's exported students (``students/<name>``; a task benchmark's ``seed_<S>/students/<recipe>``) and, with
    ``teacher``, its teachers that are model folders, each checked safe to load; a ConfigError names what is
    missing. ``run_config`` (the run config as a dict) instead of the folder's report.json: a task benchmark's seed
    folder while it runs, where a seed of the teacher row alone has no student."""
    run_dir = Path(run_dir)
    config = run_config if run_config is not None else _report(run_dir).get("config", {})
    tokenizer = config.get("tokenizer") or (config.get("teacher") if isinstance(config.get("teacher"), str) else None)
    folders = sorted(run_dir.glob("students/*")) + sorted(run_dir.glob("seed_*/students/*"))
    found = []
    for folder in (f for f in folders if f.is_dir()):
        name = str(folder.relative_to(run_dir)).replace("students/", "").replace(os.sep, "/")
        own = (folder / "tokenizer_config.json").is_file()  # the task benchmark saves its students without one
        found.append(_student(name, folder, None if own else tokenizer))
    if not found and run_config is None:
        raise ConfigError(f"{run_dir} holds no exported student (no students/<name> folder): the harness scores a "
                          "finished run's exported students; finish the run (--resume) or give its output_dir")
    if teacher:
        found = _teachers(config) + found  # the table's first row, as in the report's own table
    for model in found:
        _check_folder(model)
    return found


def _report(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "report.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no report.json: give the output_dir of a finished run "
                          "(python scripts/evaluate_run.py runs/<the run>)")
    return json.loads(path.read_text())


def _student(name: str, folder: Path, tokenizer: str | None) -> Model:
    if (folder / "merged" / "config.json").is_file():  # a LoRA student exported with its merged model
        return Model(name, "student", str(folder / "merged"), tokenizer)
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        return Model(name, "student", str(base), tokenizer or str(folder), peft=str(folder))
    return Model(name, "student", str(folder), tokenizer)


def _teachers(config: dict[str, Any]) -> list[Model]:
    """The run config's teacher(s) given as model folders or hub names (kind ``engine``). A captured store, a
    teacher class, the student itself or a server has no weights the harness can load, and is left out: a server
    with a note (its model is scored where its weights are: ``scripts/evaluate_run.py`` on a folder of them)."""
    given = config.get("teachers") or ([{"name": "teacher", "model": config["teacher"]}] if config.get("teacher")
                                        else [])
    out = []
    for spec in given:
        model, name = spec.get("model"), spec.get("name", "teacher")
        kind = kind_of(TeacherSpec(name=name, model=model, kind=spec.get("kind", "auto"))) if isinstance(
            model, str) else None
        if kind == "served":
            logger.warning("eval.harness: teacher %r is served (%s), and the harness loads model weights from a "
                           "folder: its row is left out; the students are scored as usual", name, model)
        if kind == "engine":
            out.append(Model(name, "teacher", model, config.get("tokenizer")))
    return out


def _check_folder(model: Model) -> None:
    """A local folder must hold safetensors weights and no remote code; a hub name is read from the cache."""
    for folder, weights in ((model.path, "*.safetensors"), (model.peft, "adapter_model.safetensors"),
                            (model.tokenizer, None)):
        if folder is None:
            continue
        if not Path(folder).exists():
            if folder.startswith((".", "/", "~")) or folder.count("/") > 1:  # a path, not a hub name (org/name)
                raise ConfigError(f"{model.role} {model.name!r}: {folder} does not exist")
            continue  # a hub name: transformers reads it from the cache (offline) or downloads it
        path = Path(folder)
        for name in ("config.json", "tokenizer_config.json", "adapter_config.json"):
            if (path / name).is_file() and "auto_map" in json.loads((path / name).read_text()):
                raise ConfigError(f"{model.role} {model.name!r}: {path / name} asks for the folder's own Python code "
                                  "(auto_map); the harness loads run folders without executing code "
                                  "(trust_remote_code is off): export the model as a standard architecture")
        if weights and not list(path.glob(weights)):
            raise ConfigError(f"{model.role} {model.name!r}: {path} holds no {weights} weights; the harness loads "
                              "safetensors only (no pickles): save it with save_pretrained(safe_serialization=True)")


# ---- the evaluation ------------------------------------------------------------------------------------------------

def evaluate_run(run_dir: str | Path, config: HarnessConfig, teacher: bool | None = None,
                 run_config: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Score every exported student of ``run_dir`` (and its teacher unless ``teacher`` or ``config.teacher`` says
    not) on ``config.tasks``; returns the scores :func:`add_to_report` writes, and writes each model's harness
    results and per-example answers to ``<run_dir>/harness/<model>/``. Every bad input is refused before any work.
    ``run_config``: see :func:`models` (the task benchmark scores each seed's folder with that seed's ``config``).

    In a distributed run call it on every rank (the harness spreads a model's prompts over them through accelerate);
    the scores come back on the main rank, None on the others."""
    check(config)
    run_dir = Path(run_dir)
    found = models(run_dir, config.teacher if teacher is None else teacher, run_config)
    import lm_eval

    from distill_kit.engines import distributed

    started = time.perf_counter()
    data = run_dir / "harness" / "data"
    if distributed.is_main():
        write_data(data, config)
    distributed.barrier()
    settings = asdict(config) | {"tasks": list(config.tasks)}
    scores: dict[str, Any] = {"lm_eval": lm_eval.__version__, "settings": settings, "models": {}}
    with offline(config.offline):
        manager = _task_manager(config.tasks, data)
        for model in found:
            result = _evaluate(model, config, manager, run_dir / "harness" / model.name)
            if result is not None:
                scores["models"][model.name] = result
    scores["seconds"] = time.perf_counter() - started
    return scores if distributed.is_main() else None


def write_data(folder: Path, config: HarnessConfig) -> None:
    """Each project task's seeded prompts as JSONL (``test``: ``config.examples`` held-out prompts at
    ``config.seed``; ``train``: labelled ones for few-shot), and a config that includes the shipped YAML and points
    its ``data_files`` here (the harness reads them relative to ``data_dir``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, task in PROJECT_TASKS.items():
        seeds = task.split_seeds(config.seed)
        for split, stream, count in (("test", "heldout", config.examples), ("train", "labelled", 32)):
            with (folder / f"{name}.{split}.jsonl").open("w") as handle:
                for item in task.examples(seeds[stream], count):
                    handle.write(json.dumps({"prompt": item.prompt, "answer": item.answer}) + "\n")
        overlay = {"include": str(HERE / f"{name}.yaml"), "task": name,
                   "dataset_kwargs": {"data_dir": str(folder.resolve()), "cache_dir": str(folder.resolve() / "cache"),
                                      "data_files": {s: f"{name}.{s}.jsonl" for s in ("train", "test")}}}
        (folder / f"{name}.yaml").write_text(json.dumps(overlay, indent=2) + "\n")  # JSON is YAML


def _task_manager(tasks: Any, data: Path | None = None):
    """The harness's task index: the project's tasks (their configs over ``data``), and the harness's own only when
    another name is asked for (indexing them costs about 7 s)."""
    from lm_eval.tasks import TaskManager

    others = any(name not in PROJECT_TASKS for name in tasks)
    return TaskManager(include_path=str(data) if data is not None else None, include_defaults=others or data is None)


@contextlib.contextmanager
def offline(on: bool) -> Iterator[None]:
    """No network while the harness runs: the environment variables and the flags the Hugging Face libraries read
    from them at import, restored afterwards."""
    if not on:
        yield
        return
    import datasets
    import huggingface_hub.constants as hub

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    saved = (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE)
    os.environ.update({k: "1" for k in saved_env})
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def has_chat_template(folder: str) -> bool:
    path = Path(folder)
    config = path / "tokenizer_config.json"
    return (path / "chat_template.jinja").is_file() or (
        config.is_file() and bool(json.loads(config.read_text()).get("chat_template")))


def _evaluate(model: Model, config: HarnessConfig, manager, out: Path) -> dict[str, Any] | None:
    """One model through ``HFLM`` and ``simple_evaluate``: its scores per task (the harness's metric keys, e.g.
    ``exact_match,none``), the example count, and whether its chat template was applied."""
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    from distill_kit.engines import quantize

    started = time.perf_counter()
    tokenizer = model.tokenizer or (model.peft if model.peft else model.path)
    chat = config.apply_chat_template if config.apply_chat_template is not None else has_chat_template(tokenizer)
    try:
        lm = HFLM(pretrained=model.path, tokenizer=model.tokenizer, peft=model.peft, batch_size=config.batch_size,
                  device="cuda" if torch.cuda.is_available() else "cpu", dtype="auto", trust_remote_code=False,
                  use_safetensors=True)
    except OSError as err:  # e.g. a hub name not in the cache while offline
        raise ConfigError(f"{model.role} {model.name!r}: the harness could not load {model.path}: {err}") from None
    with quantize.unpatched_linear():  # a quantized student's low-bit weights after a ZeRO-3 teacher's F.linear patch
        results = lm_eval.simple_evaluate(model=lm, tasks=list(config.tasks), num_fewshot=config.num_fewshot,
                                          limit=config.limit, task_manager=manager, apply_chat_template=chat,
                                          fewshot_as_multiturn=chat, log_samples=True, confirm_run_unsafe_code=False)
    del lm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if results is None:  # not the main rank
        return None
    out.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", {})
    for task, rows in samples.items():
        with (out / f"samples_{task}.jsonl").open("w") as handle:
            for row in rows:
                metrics = {key: row[key] for key in row.get("metrics", []) if key in row}
                handle.write(json.dumps({"doc_id": row["doc_id"], "target": row.get("target"),
                                         "response": row["filtered_resps"][0] if row.get("filtered_resps") else None,
                                         **metrics}, default=str) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    scores = {task: {k: v for k, v in values.items() if k not in ("alias", "sample_len") and isinstance(v, float)}
              for task, values in results["results"].items()}
    counts = {task: n.get("effective", n.get("original")) for task, n in results.get("n-samples", {}).items()}
    return {"role": model.role, "path": model.path, "apply_chat_template": chat, "results": scores, "n": counts,
            "seconds": time.perf_counter() - started}


# ---- the report ----------------------------------------------------------------------------------------------------

def add_to_report(run_dir: str | Path, scores: dict[str, Any] | None) -> dict[str, Any] | None:
    """``scores`` into ``<run_dir>/report.json`` (``harness``, and the table's values in its summary's ``harness``);
    returns the summary, which the report's table prints (a task benchmark's report has none: then only
    ``{"harness": ...}``). None: nothing to add (not the main rank)."""
    if scores is None:
        return None
    path = Path(run_dir) / "report.json"
    report = json.loads(path.read_text())
    report["harness"] = scores
    summary = report.get("summary")
    if summary is not None:
        summary["harness"] = summarize(scores)
    path.write_text(json.dumps(report, indent=2))
    return summary if summary is not None else {"harness": summarize(scores)}


def summarize(scores: dict[str, Any]) -> dict[str, Any]:
    """The table's part: each model's value of each task's metrics (stderr aside), and the settings."""
    settings = {k: scores["settings"][k] for k in ("tasks", "num_fewshot", "limit")}
    return {"lm_eval": scores["lm_eval"], **settings,
            "models": {name: {f"{task} {metric.removesuffix(',none')}": value
                              for task, values in row["results"].items()
                              for metric, value in values.items() if "_stderr" not in metric}
                       for name, row in scores["models"].items()}}
