"""The teacher interface: a teacher written outside the library (``tests/user_teachers.py``) runs through Python and
through the CLI by import path; every use a kind cannot serve is refused by the plan before anything loads or is
written; and the CLI builds exactly the run Python builds from the same settings."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_cli import write_texts
from tiny_models import gpt2_config
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.data.tokenizer import train_tokenizer
from distill_kit.errors import ConfigError
from distill_kit.run import cli, run_config

FIXED = "user_teachers:FixedTeacher"
TOP_K = "user_teachers:FixedTopKTeacher"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """Text files, a tokenizer, and a seeded 1-layer GPT-2 student saved with it."""
    root = tmp_path_factory.mktemp("interface")
    tokenizer = train_tokenizer(write_texts(root), vocab_size=300)
    torch.manual_seed(0)
    student = root / "student"
    GPT2LMHeadModel(gpt2_config(width=32, layers=1, vocab=len(tokenizer))).save_pretrained(student)
    tokenizer.save_pretrained(student)
    return {"root": root, "student": student, "vocab": len(tokenizer)}


def _teacher(tiny: dict, kind: str = FIXED, name: str = "fixed") -> dict:
    return {"name": name, "model": kind, "options": {"vocab_size": tiny["vocab"]}}


def _args(tiny: dict, out: Path, *teachers: dict, extra: tuple[str, ...] = ()) -> list[str]:
    return [f"output_dir={out}", f"cache_dir={out / 'cache'}", f"tokenizer={tiny['student']}",
            f"data.train={tiny['root'] / 'train.txt'}", f"data.heldout={tiny['root'] / 'heldout.txt'}",
            "data.block_size=32", "data.max_train_blocks=32", "data.max_heldout_blocks=4", "training.max_steps=3",
            "training.micro_batch_size=2", "eval.every=0", "--teachers", json.dumps(list(teachers)),
            "--students", json.dumps([{"name": "s", "model": str(tiny["student"]), "loss": "forward_kl"}]), *extra]


def test_a_teacher_of_your_own_teaches_through_python(tiny):
    """Step 1's loss is the forward KL from the fixed distribution to the untrained student, per counted token."""
    distiller = Distiller(students=[StudentSpec(name="s", model=str(tiny["student"]))],
                          teachers=[TeacherSpec(**_teacher(tiny))], training=TrainingConfig(max_steps=1, lr=1e-3))
    assert distiller.plan.cards["fixed"].kind == FIXED
    ids = torch.randint(0, tiny["vocab"], (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    (record,) = distiller.train([batch])
    student = AutoModelForCausalLM.from_pretrained(tiny["student"]).double()
    q = F.log_softmax(student(input_ids=ids).logits[:, :-1], -1)
    p = F.log_softmax(distiller.teachers.members["fixed"].z.double(), -1)
    expected = (p.exp() * (p - q)).sum(-1).mean().item()
    # float32 forward and loss against a float64 reference: each log-probability carries a few float32 ulps
    # (~1e-7 relative) through softmax over 300 ids and one GPT-2 layer; the mean KL (~3) is good to ~1e-6 relative.
    assert record["s/loss"] == pytest.approx(expected, rel=1e-5)


def test_a_teacher_of_your_own_runs_through_the_cli_as_python_runs_it(tiny, tmp_path):
    """The same settings through the CLI and through Python: the same plan (every DeepSpeed config, sample limits,
    checkpoint folder, record keys) and the same first 3 steps' losses, bit for bit."""
    config = run_config.load(None, _args(tiny, tmp_path / "cli", _teacher(tiny)))
    summary = cli.run(config)
    assert summary is not None
    report = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert [t["name"] for t in report["teachers"]] == ["fixed"]
    cli_losses = [json.loads(line)["s/loss"] for line in (tmp_path / "cli" / "train.jsonl").read_text().splitlines()]

    data = run_config.data_facts(config)
    made = cli.validate.run_plan(config, data)
    _, tokenizer, _, loader, _ = cli.prepare_loaders(dataclasses_replace_output(config, tmp_path / "py"), data,
                                                     made.tokenizer)
    python = Distiller(students=[StudentSpec(name="s", model=str(tiny["student"]), loss="forward_kl")],
                       teachers=[TeacherSpec(**_teacher(tiny))], training=config.training, data=data,
                       output_dir=tmp_path / "py", tokenizer=str(tiny["student"]))
    assert python.plan.student_ds_configs == made.student_ds_configs
    assert python.plan.teacher_ds_configs == made.teacher_ds_configs
    assert python.plan.training.on_policy == made.training.on_policy
    assert python.plan.keys == made.keys == {"s": "s"}
    assert Path(python.plan.checkpoint_dir) == tmp_path / "py" / "checkpoints"
    assert Path(made.checkpoint_dir) == tmp_path / "cli" / "checkpoints"
    python_losses = [record["s/loss"] for record in python.train(loader)]
    assert python_losses == cli_losses  # bitwise: one plan, one build, one loop


def dataclasses_replace_output(config, out: Path):
    import dataclasses

    return dataclasses.replace(config, output_dir=str(out), cache_dir=str(out / "cache"))


@pytest.mark.parametrize(("teachers", "extra", "messages"), [
    ([(TOP_K, "a"), (FIXED, "b")], ("combine=mixture",), ["combine: mixture reads every teacher's full distribution"]),
    ([(TOP_K, "a")], ("training.on_policy.fraction=0.5", "training.on_policy.sampler=teacher"),
     ["cannot generate"]),
    ([(FIXED, "a")], ("--students", '[{name: s, model: STUDENT, loss: {name: hidden_mse}}]'),
     ["reads the teacher's hidden states"]),
])
def test_every_use_a_teacher_cannot_serve_is_refused_before_any_write(tiny, tmp_path, teachers, extra, messages):
    out = tmp_path / "run"
    extra = tuple(e.replace("STUDENT", str(tiny["student"])) for e in extra)
    config = run_config.load(None, _args(tiny, out, *(_teacher(tiny, kind, name) for kind, name in teachers),
                                          extra=extra))
    with pytest.raises(ConfigError) as caught:
        cli.run(config)
    for message in messages:
        assert message in str(caught.value)
    assert not out.exists()  # refused before the folder was claimed


def test_a_top_k_teacher_trains_through_the_cli_and_its_students_are_evaluated_on_their_own(tiny, tmp_path):
    """A teacher with top-k targets only (as a store or a server gives): the run trains and reports each student's
    own held-out perplexity, with no teacher row to compare (KL and agreement need a full distribution)."""
    config = run_config.load(None, _args(tiny, tmp_path / "run", _teacher(tiny, TOP_K, "topk")))
    summary = cli.run(config)
    assert summary["teacher_perplexity"] is None
    assert summary["students"]["s"]["perplexity"] > 1 and "mean_kl" not in summary["students"]["s"]


def test_python_refuses_the_same_uses_before_loading(tiny):
    with pytest.raises(ConfigError, match="combine: route reads every teacher's full distribution"):
        Distiller(students=[StudentSpec(name="s", model=str(tiny["student"]))],
                  teachers=[TeacherSpec(**_teacher(tiny, TOP_K, "a")), TeacherSpec(**_teacher(tiny, FIXED, "b"))],
                  combine="route")
    with pytest.raises(ConfigError, match=r"teachers\[a\].options: \['k'\] are not options"):
        Distiller(students=[StudentSpec(name="s", model=str(tiny["student"]))],
                  teachers=[TeacherSpec(name="a", model=FIXED, options={"k": 3})])


def test_an_attention_loss_is_refused_without_suggesting_a_store(tiny):
    """A store or a server holds no attentions: the refusal names an in-process engine only (hidden states: a store
    captured with --hidden-layers too)."""
    for loss, what, fix in (("attention_kl", "attentions", "(an in-process engine: a store or a server holds no "
                                                           "attentions)"),
                            ("hidden_mse", "hidden states", "(an in-process engine; a store captured with "
                                                            "--hidden-layers)")):
        with pytest.raises(ConfigError) as caught:
            Distiller(students=[StudentSpec(name="s", model=str(tiny["student"]),
                                            loss={"name": loss, "layers": [[0, 0]]})],
                      teachers=[TeacherSpec(**_teacher(tiny, TOP_K, "a"))])
        assert f"students[s].loss reads the teacher's {what}, and teacher 'a'" in str(caught.value)
        assert str(caught.value).endswith(fix)


def test_each_model_config_is_read_once_per_run(tiny, tmp_path, monkeypatch):
    """The plan reads every model's config once (teacher card, student configs); the checks, the engines and the
    students' build read the plan's, never the folder again."""
    from transformers import PretrainedConfig

    from distill_kit.engines import models

    teacher = tmp_path / "teacher"
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config(width=48, layers=2, vocab=tiny["vocab"])).save_pretrained(teacher)
    reads: dict[str, int] = {}
    original = PretrainedConfig.get_config_dict.__func__

    def counted(cls, source, **kwargs):
        if not any("tokenization_auto" in frame.filename for frame in traceback.extract_stack()):  # a tokenizer's
            reads[str(source)] = reads.get(str(source), 0) + 1                                   # read is not one
        return original(cls, source, **kwargs)

    monkeypatch.setattr(PretrainedConfig, "get_config_dict", classmethod(counted))
    out = tmp_path / "run"
    args = [a for a in _args(tiny, out, _teacher(tiny)) if not a.startswith("[")]
    args = [a for a in args if a not in ("--teachers", "--students")]
    config = run_config.load(None, [*args, f"teacher={teacher}", "--students",
                                    json.dumps([{"name": "given", "model": str(tiny["student"])},
                                                {"name": "fresh", "init": {"n_layer": 1}}])])
    assert cli.run(config) is not None
    assert reads == {str(teacher): 1, str(tiny["student"]): 1}, reads
    assert models.model_config(teacher) is not None  # (the counter works: this read is the test's own)
    assert reads[str(teacher)] == 2


def _blocks(vocab: int, count: int = 12, length: int = 16):
    import datasets

    ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(2))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                       "labels": ids.tolist()}).with_format("torch")


def test_a_prefetching_teacher_hears_of_every_next_micro_batch_across_steps_and_resume_is_unchanged(tiny, tmp_path):
    """Gradient accumulation 1: the loop reads the next step's micro-batch before this step's trains, so the teacher
    is told of every micro-batch but the first before its forward. A checkpoint taken with a micro-batch read ahead
    records where the data stood before that read, so resuming from step 2's checkpoint gives steps 3 and 4 again
    (losses, and the micro-batches the teacher is asked about)."""
    from distill_kit.data.blocks import BlockLoader

    def distiller(folder: Path) -> Distiller:
        return Distiller(students=[StudentSpec(name="s", model=str(tiny["student"]))],
                         teachers=[TeacherSpec(**_teacher(tiny, "user_teachers:PrefetchingTeacher"))],
                         training=TrainingConfig(max_steps=4, lr=1e-3, micro_batch_size=2, save_every=2,
                                                 checkpoint_dir=str(folder)))

    whole = distiller(tmp_path / "whole")
    assert whole.reads_ahead
    records = whole.train(BlockLoader(_blocks(tiny["vocab"]), 2, seed=5))
    teacher = whole.teachers.members["fixed"]
    assert len(teacher.asked) == 4 and teacher.prefetched == teacher.asked[1:]  # told ahead of all but the first

    resumed = distiller(tmp_path / "resumed")
    resumed.load(tmp_path / "whole" / "step_00000002")  # saved with step 3's micro-batch read ahead
    rest = resumed.train(BlockLoader(_blocks(tiny["vocab"]), 2, seed=5))
    assert rest == records[2:]
    assert resumed.teachers.members["fixed"].asked == teacher.asked[2:]
