"""``scripts/distill.py``: config handling, and a tiny real run on 1 rank (python) and 2 ranks (deepspeed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launch import ROOT, run_ranks
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from distill_kit.data import blocks
from distill_kit.data.tokenizer import train_tokenizer
from distill_kit.run import run_config

SCRIPT = ROOT / "scripts/distill.py"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A teacher with its own tokenizer, and train/held-out text files, all local."""
    root = tmp_path_factory.mktemp("tiny")
    sources = sorted(Path(json.__file__).parent.glob("*.py")) + sorted(Path(run_config.__file__).parent.glob("*.py"))
    texts = [p.read_text() for p in sources]
    (root / "train.txt").write_text("\n".join(texts[1:]))
    (root / "heldout.txt").write_text(texts[0])
    tokenizer = train_tokenizer(texts, vocab_size=300)
    teacher = root / "teacher"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=48, n_layer=2, n_head=4, n_positions=64,
                               resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    return {"root": root, "teacher": teacher}


def _run_args(tiny: dict[str, Path], out: Path) -> list[str]:
    return [
        f"teacher={tiny['teacher']}", f"output_dir={out}", f"cache_dir={out / 'cache'}",
        f"data.train={tiny['root'] / 'train.txt'}", f"data.heldout={tiny['root'] / 'heldout.txt'}",
        "data.block_size=32", "data.max_train_blocks=64", "data.max_heldout_blocks=12",
        "training.max_steps=6", "training.micro_batch_size=2", "training.lr=3e-3", "eval.every=3",
        "--students", "[{name: distilled, init: {n_layer: 1, n_embd: 32}, loss: forward_kl},"
        " {name: no_teacher, init: {n_layer: 1, n_embd: 32}, loss: cross_entropy}]",
    ]


def _heldout_perplexity(model_dir: Path, tiny: dict[str, Path]) -> float:
    """Perplexity of an exported student over every held-out block, with plain transformers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = blocks.DataConfig(train=str(tiny["root"] / "train.txt"), heldout=str(tiny["root"] / "heldout.txt"),
                               block_size=32, max_heldout_blocks=12)
    heldout = blocks.build_splits(config, tokenizer).heldout.with_format("torch")
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for row in heldout:
            logits = model(input_ids=row["input_ids"][None], attention_mask=row["attention_mask"][None]).logits[0, :-1]
            labels = row["labels"][1:]
            keep = labels != -100
            nll += F.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            tokens += int(keep.sum())
    return math.exp(nll / tokens)


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [0, 2])
def test_tiny_run_end_to_end(tiny, tmp_path, ranks):
    """1 rank under plain python, 2 ranks under the deepspeed launcher: report, curves, exported students."""
    out = tmp_path / "run"
    if ranks:
        run_ranks(ROOT / "tests/workers/cli_run.py", _run_args(tiny, out), nprocs=2, launcher="deepspeed")
    else:
        run_ranks(SCRIPT, _run_args(tiny, out), nprocs=0)
    report = json.loads((out / "report.json").read_text())
    students = report["summary"]["students"]
    assert set(students) == {"distilled", "no_teacher"}
    assert "perplexity_reduction_vs_no_teacher" in students["distilled"]
    assert [e["step"] for e in report["evaluations"]] == [3, 6]
    # The engines ran the run config's optimizer settings, and the report says so.
    engine = report["deepspeed_configs"]["students"]["distilled"]
    assert engine["optimizer"]["params"]["betas"] == report["config"]["training"]["betas"] == [0.9, 0.95]
    assert engine["gradient_clipping"] == report["config"]["training"]["max_grad_norm"]
    assert [r["distilled/lr"] for r in _jsonl(out / "train.jsonl")] == pytest.approx(
        [3e-3 * f for f in (1 / 20, 2 / 20, 3 / 20, 4 / 20, 5 / 20, 6 / 20)], rel=1e-12)  # warm-up 20 > 6 steps
    for name in students:
        # The exported student reloads and reproduces the perplexity measured on the model in training.
        exported = _heldout_perplexity(out / "students" / name, tiny)
        assert exported == pytest.approx(students[name]["perplexity"], rel=1e-4)
    assert [r["step"] for r in _jsonl(out / "train.jsonl")] == list(range(1, 7))
    if ranks:
        return
    # The same folder again: refused without --resume; with it, the run continues from its last checkpoint.
    again = _cli(*_run_args(tiny, out), "training.max_steps=9")
    assert again.returncode != 0 and "holds checkpoints of this run: resume it (--resume)" in again.stderr
    run_ranks(SCRIPT, [*_run_args(tiny, out), "training.max_steps=9", "--resume"], nprocs=0)
    assert [r["step"] for r in _jsonl(out / "train.jsonl")] == list(range(1, 10))
    assert [e["step"] for e in json.loads((out / "report.json").read_text())["evaluations"]] == [3, 6, 9]
    other = _cli(*_run_args(tiny, out), "training.lr=1e-2", "--resume")
    assert other.returncode != 0 and "holds another run (training.lr: 0.003 -> 0.01)" in other.stderr


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_help_lists_every_field():
    done = _cli("--help")
    assert done.returncode == 0
    for key in ("training.lr", "training.micro_batch_size", "data.block_size", "eval.every", "students",
                "teacher_ds_overrides", "output_dir"):
        assert key in done.stdout


def test_print_config_applies_file_then_flags(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("training:\n  lr: 0.01\n  max_steps: 7\nteacher_ds_config: other.json\n")
    done = _cli("--config", str(run_file), "--training.lr", "2e-3", "--print-config")
    assert done.returncode == 0, done.stderr
    printed = done.stdout[done.stdout.index("teacher:"):]
    import yaml
    config = yaml.safe_load(printed)
    assert config["training"]["lr"] == 2e-3 and config["training"]["max_steps"] == 7
    assert config["teacher_ds_config"] == "other.json"


@pytest.mark.parametrize(("args", "message"), [
    (["--training.lrr", "1"], "unknown config key 'training.lrr': did you mean 'training.lr'?"),
    (["--trainig.lr", "1"], "unknown config key 'trainig': did you mean 'training'?"),
    (["--training.max_steps", "many"], "training.max_steps: expected int"),
    (["--config", "no/such/run.yaml"], "run config 'no/such/run.yaml' does not exist"),
    (["--training.dtype", "fp8"], "training.dtype: 'fp8' is not one of"),
    (["teacher=/no/such/teacher"], "teacher: '/no/such/teacher' does not exist"),
])
def test_bad_input_is_a_clear_error(args, message):
    done = _cli(*args)
    assert done.returncode != 0
    assert message in done.stderr
