"""lm-evaluation-harness on a run folder (``distill_kit/tasks/harness``): the hook scores an exported student and the
teacher into report.json, the harness's arithmetic exact match is the project's own checker example by example, and
every bad input is refused before any work. One harness evaluation (24 prompts, two models) serves the module; a
tiny task benchmark (two seeds) checks the harness's column against the checker's, seed by seed and example by
example."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from launch import ROOT, run_ranks
from test_cli import _main_error
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill_kit.config import HarnessConfig
from distill_kit.errors import ConfigError
from distill_kit.run import report, run_config
from distill_kit.tasks import arithmetic, harness
from distill_kit.tasks.evaluate import exact_match, generate_answers

TEACHER = ROOT / "distill_kit/assets/arithmetic/teacher"
SCRIPT = ROOT / "scripts/distill.py"
PROMPTS = 24
ARITHMETIC = HarnessConfig(tasks=("distill_kit_arithmetic",), limit=PROMPTS, batch_size=8, examples=PROMPTS)


def noisy_student(folder: Path) -> Path:
    """The arithmetic teacher with seeded noise on every weight: right on about half the prompts (54% of these 24),
    so a per-example comparison compares both outcomes, and with answers that run on or stop early."""
    model = AutoModelForCausalLM.from_pretrained(TEACHER)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.5)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TEACHER).save_pretrained(folder)
    return folder


def run_folder(out: Path, students: dict[str, Path] | None = None) -> Path:
    """A finished run's folder as the CLI leaves it: report.json (the real writer) and students/<name>."""
    out.mkdir(parents=True, exist_ok=True)
    for name, make in (students or {}).items():
        make(out / "students" / name)
    names = list(students or {"student": None})
    evaluations = [{"step": 1, "metrics": {"teacher": {"perplexity": 1.5}, **{n: {"perplexity": 2.0} for n in names}}}]
    report.write(out, {"teacher": str(TEACHER)}, {n: "forward_kl" for n in names}, {n: [] for n in names},
                 evaluations, {})
    return out


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    out = run_folder(tmp_path_factory.mktemp("run"), {"noisy": noisy_student})
    summary = harness.add_to_report(out, harness.evaluate_run(out, ARITHMETIC))
    return out, summary


def test_the_hook_scores_each_student_and_the_teacher_into_report_json(scored):
    out, summary = scored
    saved = json.loads((out / "report.json").read_text())
    models = saved["harness"]["models"]
    assert list(models) == ["teacher", "noisy"]  # the teacher once, then each exported student
    assert models["teacher"]["role"] == "teacher" and models["noisy"]["role"] == "student"
    assert models["teacher"]["results"]["distill_kit_arithmetic"]["exact_match,none"] == 1.0  # it learned the task
    assert 0.2 < models["noisy"]["results"]["distill_kit_arithmetic"]["exact_match,none"] < 0.8
    assert models["noisy"]["n"] == {"distill_kit_arithmetic": PROMPTS} and models["noisy"]["apply_chat_template"]
    assert saved["harness"]["settings"]["tasks"] == ["distill_kit_arithmetic"]
    assert saved["summary"]["harness"] == summary["harness"]
    assert summary["harness"]["models"]["teacher"] == {"distill_kit_arithmetic exact_match": 1.0}
    assert saved["summary"]["students"]["noisy"]["perplexity"] == 2.0  # the run's own report is kept
    printed = report.table(summary)
    assert "lm-evaluation-harness 0.4.13" in printed and "distill_kit_arithmetic exact_match" in printed
    assert (out / "harness/noisy/results.json").is_file()
    assert len((out / "harness/noisy/samples_distill_kit_arithmetic.jsonl").read_text().splitlines()) == PROMPTS


def test_harness_exact_match_is_the_projects_checker_example_by_example(scored):
    """The same prompts, the same model: the harness (HFLM, its chat-template prompt, its stop handling) and the
    project's own greedy answers and checker agree on every example, answer text included."""
    out, _ = scored
    rows = [json.loads(line) for line in (out / "harness/noisy/samples_distill_kit_arithmetic.jsonl").open()]
    rows.sort(key=lambda row: row["doc_id"])
    items = list(arithmetic.examples(arithmetic.split_seeds(ARITHMETIC.seed)["heldout"], PROMPTS))
    model = AutoModelForCausalLM.from_pretrained(out / "students/noisy")
    tokenizer = AutoTokenizer.from_pretrained(out / "students/noisy")
    answers = generate_answers(model, tokenizer, items, max_new_tokens=32)
    ours = [arithmetic.check(item.prompt, answer) for item, answer in zip(items, answers, strict=True)]
    assert [row["exact_match"] == 1.0 for row in rows] == ours
    assert [row["response"] for row in rows] == answers
    assert 0 < sum(ours) < len(ours)  # both outcomes compared
    assert exact_match(model, tokenizer, items) == pytest.approx(sum(ours) / len(ours))


def test_bad_input_is_refused_before_any_work(tmp_path, monkeypatch):
    empty = run_folder(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no exported student"):
        harness.evaluate_run(empty, ARITHMETIC)
    with pytest.raises(ConfigError, match="no report.json"):
        harness.evaluate_run(tmp_path / "nowhere", ARITHMETIC)
    with pytest.raises(ConfigError, match=r"unknown task 'distill_kit_arithmetik' \(did you mean "
                                          r"'distill_kit_arithmetic'\?\)"):
        harness.evaluate_run(empty, HarnessConfig(tasks=("distill_kit_arithmetik",)))
    assert not (empty / "harness").exists()

    def remote_code(folder: Path) -> None:  # a config asking for the folder's own Python
        AutoModelForCausalLM.from_pretrained(TEACHER).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModelForCausalLM": "m.M"}}))

    def pickled(folder: Path) -> None:  # weights only as a pickle
        AutoModelForCausalLM.from_pretrained(TEACHER).save_pretrained(folder, safe_serialization=False)
        for file in folder.glob("*.safetensors"):
            file.unlink()

    for make, message in ((remote_code, "auto_map"), (pickled, "safetensors only")):
        out = run_folder(tmp_path / make.__name__, {"s": make})
        with pytest.raises(ConfigError, match=message):
            harness.evaluate_run(out, ARITHMETIC, teacher=False)
        assert not (out / "harness").exists()

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'distill-kit\[eval\]'"):
        harness.evaluate_run(empty, ARITHMETIC)


def test_settings_are_checked_and_read_from_the_run_config():
    with pytest.raises(ConfigError, match="eval.harness.limit: 0"):
        run_config.load(None, ["--eval.harness.limit", "0"])
    with pytest.raises(ConfigError, match="did you mean 'eval.harness.tasks'"):
        run_config.load(None, ["--eval.harness.task", "[gsm8k]"])
    config = run_config.load(None, ["--eval.harness.tasks", "[distill_kit_arithmetic, gsm8k]"])
    assert config.eval.harness.tasks == ("distill_kit_arithmetic", "gsm8k")
    assert run_config.load(None, []).eval.harness.tasks == ()  # off by default


def test_offline_sets_and_restores_the_hubs_flags(monkeypatch):
    import datasets
    import huggingface_hub.constants as hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    with harness.offline(True):
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
        assert hub.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == before and "HF_HUB_OFFLINE" not in os.environ


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_task_benchmark_scores_each_seeds_models_with_the_harness_on_the_checkers_prompts(tmp_path):
    """eval.harness in a task benchmark: at each seed the harness scores that seed's saved students and the teacher
    on the seed's own held-out prompts (task.heldout of them), and its exact match is the checker's, per seed and
    per example, answer text included; the column goes over the seeds like the checker's (mean, range, each seed),
    into report.json and the printed table. Another harness task (sorting, in an arithmetic benchmark) is a column
    of its own. The student is the noisy teacher, barely trained (one step, warm-up learning rate), so that its
    answers are right on about half the prompts at each seed."""
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "configs/arithmetic.yaml"), "--output_dir", str(out),
            "--students", f"[{{name: student, model: {noisy_student(tmp_path / 'noisy')}}}]",
            "--training.max_steps", "1", "--training.micro_batch_size", "4", "--task.labelled", "4",
            "--task.prompts", "4", "--task.heldout", "16", "--task.recipes", "[teacher, sft]", "--task.seeds", "[0, 1]",
            "--eval.harness.tasks", "[distill_kit_arithmetic, distill_kit_sorting]", "--eval.harness.batch_size", "16"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI tests' processes run (OMP_NUM_THREADS=1): tiny models, many small ops
    try:
        done = run_ranks(SCRIPT, args, nprocs=0)
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((out / "report.json").read_text())
    both = 0
    for entry in saved["per_seed"]:
        seed, folder = entry["seed"], out / f"seed_{entry['seed']}"
        prompts = [item.prompt for item in arithmetic.examples(arithmetic.split_seeds(seed)["heldout"], 16)]
        assert [r["prompt"] for r in _jsonl(folder / "harness/data/distill_kit_arithmetic.test.jsonl")] == prompts
        assert entry["harness"]["settings"]["seed"] == seed and list(entry["harness"]["models"]) == ["teacher", "sft"]
        for row in entry["rows"]:
            ours = _jsonl(folder / "answers" / f"{row['recipe']}.jsonl")
            theirs = sorted(_jsonl(folder / "harness" / row["recipe"] / "samples_distill_kit_arithmetic.jsonl"),
                            key=lambda sample: sample["doc_id"])
            assert [r["prompt"] for r in ours] == prompts
            assert [r["exact_match"] == 1.0 for r in theirs] == [r["exact_match"] for r in ours]
            assert [r["response"] for r in theirs] == [r["response"] for r in ours]
            assert row["harness_exact_match"] == pytest.approx(row["exact_match"])
            assert "harness_distill_kit_sorting_exact_match" in row
            both += 0 < row["exact_match"] < 1
    assert both >= 1  # a row with right and wrong answers: both outcomes compared
    for row in saved["rows"]:
        assert row["harness_exact_match_per_seed"] == pytest.approx(row["exact_match_per_seed"])
        assert row["harness_exact_match"] == pytest.approx(row["exact_match"])
        assert (row["harness_exact_match_min"], row["harness_exact_match_max"]) == pytest.approx(
            (row["exact_match_min"], row["exact_match_max"]))
    assert "harness" in done.stdout and "distill_kit_sorting_exact_match" in done.stdout

    # scripts/evaluate_run.py on the finished folder scores it the same way, seed by seed: a setting the task run
    # refuses is refused before any write; rescoring with arithmetic alone replaces the harness columns
    evaluate_run = _script("evaluate_run")
    before = (out / "report.json").read_text()
    with pytest.raises(SystemExit, match="eval.harness.limit"):
        evaluate_run.main([str(out), "--tasks", "distill_kit_arithmetic", "--limit", "4"])
    assert (out / "report.json").read_text() == before
    torch.set_num_threads(1)
    try:
        assert evaluate_run.main([str(out), "--tasks", "distill_kit_arithmetic"]) == 0
    finally:
        torch.set_num_threads(threads)
    rescored = json.loads((out / "report.json").read_text())
    for entry in rescored["per_seed"]:
        prompts = [item.prompt for item in arithmetic.examples(arithmetic.split_seeds(entry["seed"])["heldout"], 16)]
        data = out / f"seed_{entry['seed']}" / "harness/data/distill_kit_arithmetic.test.jsonl"
        assert [r["prompt"] for r in _jsonl(data)] == prompts  # the seed's own prompts, not one seed's for all
    for row, first in zip(rescored["rows"], saved["rows"], strict=True):
        assert row["harness_exact_match_per_seed"] == pytest.approx(first["harness_exact_match_per_seed"])
        assert not any("sorting" in key for key in row)


def _script(name: str):
    """A script of scripts/ as a module (its ``main``), without putting scripts/ on the path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_bad_harness_setting_in_a_task_benchmark_is_refused_before_any_write(tmp_path, monkeypatch):
    run = ["--config", str(ROOT / "configs/arithmetic.yaml"), "--output_dir", str(tmp_path / "run"),
           "--task.seeds", "[0]"]
    message = _main_error(*run, "--eval.harness.tasks", "[distill_kit_arithmetik]")
    assert "unknown task 'distill_kit_arithmetik' (did you mean 'distill_kit_arithmetic'?)" in message
    message = _main_error(*run, "--eval.harness.tasks", "[distill_kit_arithmetic]", "--eval.harness.limit", "100")
    assert "eval.harness.limit: in a task benchmark the harness scores each seed's held-out prompts" in message
    assert "drop eval.harness.limit, or set task.heldout" in message
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert "pip install 'distill-kit[eval]'" in _main_error(*run, "--eval.harness.tasks", "[distill_kit_arithmetic]")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, message", [
    (["--eval.harness.num_fewshot", "3"], "eval.harness.num_fewshot: 3 puts 3 solved examples before each prompt"),
    (["--eval.harness.apply_chat_template", "false"], "eval.harness.apply_chat_template: false sends each prompt "
                                                      "without the chat template")])
def test_a_harness_setting_that_changes_what_is_scored_is_refused_in_a_task_benchmark(tmp_path, setting, message):
    """Beside the checker's column, the harness must ask the same zero-shot chat prompts: a setting that changes
    them is refused by the run config, before any write, naming the key and why; in a run without task.name, or
    with only the harness's own tasks, it is the user's to choose."""
    run = ["--config", str(ROOT / "configs/arithmetic.yaml"), "--output_dir", str(tmp_path / "run"),
           "--task.seeds", "[0]"]
    error = _main_error(*run, "--eval.harness.tasks", "[distill_kit_sorting, gsm8k]", *setting)
    assert message in error and "in a task benchmark the harness scores ['distill_kit_sorting'] beside the checker" \
        in error and f"drop {setting[0].removeprefix('--')}" in error
    assert not (tmp_path / "run").exists()
    assert run_config.load(str(ROOT / "configs/arithmetic.yaml"), ["--eval.harness.tasks", "[gsm8k]", *setting])
    assert run_config.load(None, ["--eval.harness.tasks", "[distill_kit_arithmetic]", *setting])
    assert run_config.load(str(ROOT / "configs/arithmetic.yaml"), ["--eval.harness.tasks", "[distill_kit_arithmetic]",
                                                                   "--eval.harness.num_fewshot", "0"])


def test_a_served_teacher_is_left_out_of_the_harness_with_a_note(tmp_path, caplog):
    """The harness loads weights from a folder; a teacher given as a server's URL (alone, or among teachers) is not
    taken for one after training: its row is left out, with a note, and the students are scored."""
    out = run_folder(tmp_path / "run", {"s": lambda folder: AutoModelForCausalLM.from_pretrained(TEACHER)
                                        .save_pretrained(folder)})
    with caplog.at_level("WARNING", logger=harness.__name__):
        found = harness.models(out, run_config={"teacher": "http://127.0.0.1:8100", "tokenizer": str(TEACHER)})
        assert [(m.name, m.role) for m in found] == [("s", "student")]
        several = {"teachers": [{"name": "far", "model": "https://teacher.example:8443"},
                                {"name": "near", "model": str(TEACHER)}]}
        found = harness.models(out, run_config=several)
    assert [(m.name, m.role) for m in found] == [("near", "teacher"), ("s", "student")]
    assert "teacher 'teacher' is served (http://127.0.0.1:8100)" in caplog.text and "'far' is served" in caplog.text
