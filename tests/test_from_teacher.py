"""Students cut out of their teacher: kept layers compute what the teacher's layers compute, pruning nothing
changes nothing, importance keeps the units that carry signal, and a ZeRO-3 teacher on 2 ranks gives the
same student as a plain one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import ROOT, run_ranks
from test_cli import _main_error
from tiny_models import llama_config, qwen2_config, random_batches
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM

from distill_kit.data.tokenizer import train_tokenizer
from distill_kit.errors import ConfigError
from distill_kit.run import run_config, validate
from distill_kit.students.from_teacher import (
    FromTeacherConfig,
    UnsupportedTeacherError,
    kept_heads,
    measure_importance,
    student_from_teacher,
    teacher_shape,
)

ARCHITECTURES = {"llama": (LlamaForCausalLM, llama_config), "qwen2": (Qwen2ForCausalLM, qwen2_config)}


def make_teacher(kind: str, seed: int = 0, **overrides):
    model_cls, config = ARCHITECTURES[kind]
    torch.manual_seed(seed)
    teacher = model_cls(config(**overrides)).eval()
    with torch.no_grad():  # RMSNorm weights start at 1; random ones make every channel's scale matter
        for name, param in teacher.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return teacher


def batches(count: int = 3, seed: int = 7):
    return random_batches(count, batch=2, length=16, seed=seed)


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_keeping_everything_gives_the_teacher_exactly(kind):
    teacher = make_teacher(kind)
    shape = teacher_shape(teacher.config)
    plain = student_from_teacher(teacher, FromTeacherConfig())
    # Width "pruning" to the teacher's own sizes measures importance, ranks, and keeps every unit in order.
    same_sizes = student_from_teacher(teacher, FromTeacherConfig(
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads), batches())
    for student in (plain, same_sizes):
        for batch in batches(2, seed=11):
            assert torch.equal(logits(student, batch), logits(teacher, batch))


def run_kept_layers(teacher, input_ids, layers):
    """The teacher's own modules, called by hand: embeddings, the kept layers in order, final norm, head."""
    base = teacher.model
    with torch.no_grad():
        hidden = base.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1])[None]
        rotary = base.rotary_emb(hidden, position_ids=positions)
        for i in layers:
            hidden = base.layers[i](hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return teacher.lm_head(base.norm(hidden))


@pytest.mark.parametrize(("kind", "choice", "layers"), [
    ("llama", {"every": 2}, [0, 2]),
    ("llama", {"layers": (3, 1)}, [3, 1]),
    ("qwen2", {"first": 3}, [0, 1, 2]),
    ("qwen2", {"last": 2}, [2, 3]),
])
def test_kept_layers_compute_what_the_teachers_layers_compute(kind, choice, layers):
    teacher = make_teacher(kind)
    student = student_from_teacher(teacher, FromTeacherConfig(**choice))
    assert student.config.num_hidden_layers == len(layers)
    input_ids = torch.randint(1, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = student(input_ids=input_ids).logits
    torch.testing.assert_close(got, run_kept_layers(teacher, input_ids, layers), rtol=1e-5, atol=1e-5)


def dead_units(teacher):
    """Zero the weights that feed chosen neurons, heads and hidden channels: their activations are exactly 0.

    Hidden channel 5 and 17: embedding column and every norm weight zero. MLP neurons 3, 10, 40 in every layer:
    gate and up rows zero. Attention: the value rows of key-value group 1 (Qwen2: query heads 2 and 3 read it;
    Llama: head 1 alone).
    """
    shape = teacher_shape(teacher.config)
    dead_group = 1
    dead_heads = [h for h in range(shape.num_attention_heads)
                  if h // (shape.num_attention_heads // shape.num_key_value_heads) == dead_group]
    with torch.no_grad():
        teacher.model.embed_tokens.weight[:, [5, 17]] = 0
        for name, param in teacher.named_parameters():
            if name.endswith("norm.weight"):
                param[[5, 17]] = 0
        for layer in teacher.model.layers:
            layer.mlp.gate_proj.weight[[3, 10, 40]] = 0
            layer.mlp.up_proj.weight[[3, 10, 40]] = 0
            rows = slice(dead_group * shape.head_dim, (dead_group + 1) * shape.head_dim)
            layer.self_attn.v_proj.weight[rows] = 0
            if layer.self_attn.v_proj.bias is not None:
                layer.self_attn.v_proj.bias[rows] = 0
    return [5, 17], [3, 10, 40], dead_heads


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_importance_drops_the_units_that_carry_nothing(kind):
    teacher = make_teacher(kind)
    dead_channels, dead_neurons, dead_heads = dead_units(teacher)
    shape = teacher_shape(teacher.config)
    importance = measure_importance(teacher, batches(), layers=[0, 1, 2, 3])
    assert torch.all(importance.hidden[dead_channels] == 0) and torch.all(importance.hidden.abs().sum() > 0)
    for i in range(4):
        alive = [j for j in range(shape.intermediate_size) if j not in dead_neurons]
        assert torch.all(importance.neurons[i][dead_neurons] == 0) and torch.all(importance.neurons[i][alive] > 0)
        assert torch.all(importance.heads[i][dead_heads] == 0)

    # Pruning only dead neurons and heads removes terms that add exactly zero: the model computes the same.
    kept_heads_count = shape.num_attention_heads - len(dead_heads)
    kept_groups = shape.num_key_value_heads - 1
    student = student_from_teacher(teacher, FromTeacherConfig(
        intermediate_size=shape.intermediate_size - len(dead_neurons), num_attention_heads=kept_heads_count,
        num_key_value_heads=kept_groups), batches())
    assert (student.config.intermediate_size, student.config.num_attention_heads,
            student.config.num_key_value_heads) == (45, kept_heads_count, kept_groups)
    for batch in batches(2, seed=11):
        torch.testing.assert_close(logits(student, batch), logits(teacher, batch), rtol=1e-5, atol=1e-5)

    # Hidden pruning keeps every live channel: the student's embeddings are the teacher's without columns 5, 17.
    narrow = student_from_teacher(teacher, FromTeacherConfig(hidden_size=30), batches())
    live = [c for c in range(32) if c not in dead_channels]
    assert torch.equal(narrow.model.embed_tokens.weight, teacher.model.embed_tokens.weight[:, live])
    assert narrow.config.head_dim == shape.head_dim


def test_heads_are_kept_by_whole_key_value_groups():
    teacher = teacher_shape(qwen2_config(num_attention_heads=8, num_key_value_heads=4, hidden_size=64))
    student = teacher_shape(qwen2_config(num_attention_heads=2, num_key_value_heads=2, hidden_size=64))
    importance = torch.tensor([1.0, 5.0, 2.0, 2.0, 0.1, 0.1, 9.0, 0.0])  # group sums: 6, 4, 0.2, 9
    groups, heads = kept_heads(importance, teacher, student)
    assert groups.tolist() == [0, 3] and heads.tolist() == [1, 6]  # in each kept group, its best query head


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_pruned_student_round_trips_through_from_pretrained(kind, tmp_path):
    teacher = make_teacher(kind)
    student = student_from_teacher(teacher, FromTeacherConfig(
        every=2, hidden_size=24, intermediate_size=20, num_attention_heads=2), batches())
    student.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    expected_kv = 2 if kind == "llama" else 1  # Qwen2 keeps 2 query heads per group: one group of two
    assert {k: saved[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "head_dim")} == {
        "num_hidden_layers": 2, "hidden_size": 24, "intermediate_size": 20, "num_attention_heads": 2,
        "num_key_value_heads": expected_kv, "head_dim": 8}
    assert type(loaded) is type(teacher)
    for batch in batches(2, seed=11):
        assert torch.equal(logits(loaded, batch), logits(student, batch))


@pytest.mark.parametrize(("choice", "message"), [
    ({"layers": (0, 9)}, "layers [9] do not exist: the teacher has layers 0..3"),
    ({"layers": (1, 1)}, "name a layer twice"),
    ({"first": 5}, "first: 5 layers asked for, the teacher has 4"),
    ({"hidden_size": 64}, "hidden_size: the student keeps at most the teacher's 32, not 64"),
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, "num_attention_heads must be num_key_value_heads times"),
    ({"hidden_size": 16}, "width pruning needs calibration batches"),
])
def test_bad_choices_name_the_fix(choice, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        student_from_teacher(make_teacher("qwen2"), FromTeacherConfig(**choice))


def test_config_refuses_two_depth_choices_and_other_architectures():
    with pytest.raises(ValueError, match="at most one of layers, every, first, last"):
        FromTeacherConfig(every=2, first=3)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4))
    with pytest.raises(UnsupportedTeacherError, match=r"model_type \['llama', 'qwen2'\].*'gpt2'.*students\[i\].init"):
        student_from_teacher(gpt2, FromTeacherConfig(every=2))


@pytest.mark.multirank
def test_a_zero3_teacher_on_two_ranks_gives_the_same_student(tmp_path):
    """Two ranks, the teacher in ZeRO-3 shards gathered one layer at a time, against the plain teacher here."""
    teacher = make_teacher("qwen2")
    teacher.save_pretrained(tmp_path / "teacher")
    run_ranks(ROOT / "tests/workers/from_teacher_worker.py", [str(tmp_path)], nprocs=2)
    sharded = torch.load(tmp_path / "student.pt")
    assert json.loads((tmp_path / "partitioned.json").read_text()) == {"0": True, "1": True}
    expected = student_from_teacher(AutoModelForCausalLM.from_pretrained(tmp_path / "teacher"),
                                    FromTeacherConfig(**WORKER_CHOICE), batches()).state_dict()
    assert sharded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(sharded[name], tensor), name


WORKER_CHOICE = {"layers": (0, 3), "hidden_size": 24, "intermediate_size": 20, "num_attention_heads": 2}


# ---- through scripts/distill.py ---------------------------------------------------------------------------------

SCRIPT = ROOT / "scripts/distill.py"
CUT = "{every: 2, hidden_size: 24, intermediate_size: 20, num_attention_heads: 2}"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny Llama teacher with its own tokenizer, and train/held-out text files."""
    root = tmp_path_factory.mktemp("tiny_llama")
    texts = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    (root / "train.txt").write_text("\n".join(texts[1:]))
    (root / "heldout.txt").write_text(texts[0])
    tokenizer = train_tokenizer(texts, vocab_size=300)
    make_teacher("llama", vocab_size=len(tokenizer)).save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    return root


def _args(root: Path, out: Path, students: str) -> list[str]:
    return [f"teacher={root / 'teacher'}", f"output_dir={out}", f"cache_dir={out / 'cache'}",
            f"data.train={root / 'train.txt'}", f"data.heldout={root / 'heldout.txt'}", "data.block_size=32",
            "data.max_train_blocks=32", "data.max_heldout_blocks=8", "training.max_steps=2",
            "training.micro_batch_size=2", "--students", students]


def _check_cuts(config):
    """The CLI's start-up check of every ``init_from_teacher``, as it reports problems."""
    problems = validate.check_plan(validate.Start(config, resume=False, identity={}))
    if problems:
        raise ConfigError("\n".join(problems))


@pytest.mark.parametrize(("students", "message"), [
    ("[{name: a, init: {hidden_size: 8}, init_from_teacher: {every: 2}}]",
     "students[0]: init_from_teacher builds the student itself; drop model and init"),
    ("[{name: a, init_from_teacher: {every: 2, last: 1}}]", "give at most one of layers, every, first, last"),
    ("[{name: a, init_from_teacher: {layers: [0, 9]}}]",
     "students[a].init_from_teacher: layers [9] do not exist: the teacher has layers 0..3"),
    ("[{name: a, init_from_teacher: {hidden_size: 64}}]",
     "students[a].init_from_teacher: hidden_size: the student keeps at most the teacher's 32, not 64"),
])
def test_bad_choices_in_a_run_config_are_config_errors(tiny_llama, tmp_path, students, message):
    with pytest.raises(ConfigError) as caught:
        _check_cuts(run_config.load(None, _args(tiny_llama, tmp_path, students)))
    assert message in str(caught.value)


def test_an_unsupported_teacher_is_a_config_error(tmp_path):
    GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4)).save_pretrained(tmp_path / "gpt2")
    config = run_config.load(None, [f"teacher={tmp_path / 'gpt2'}", "--students", "[{name: a, init_from_teacher: {}}]"])
    with pytest.raises(ConfigError, match=r"students\[a\].init_from_teacher: init_from_teacher supports teachers "
                                          r"of model_type \['llama', 'qwen2'\].*'gpt2'"):
        _check_cuts(config)


def test_the_cli_stops_on_a_bad_choice_before_any_work(tiny_llama, tmp_path):
    got = _main_error(*_args(tiny_llama, tmp_path / "run", "[{name: a, init_from_teacher: {layers: [0, 9]}}]"))
    assert "config error: students[a].init_from_teacher: layers [9] do not exist" in got
    assert not (tmp_path / "run" / "cache").exists()  # no corpus, tokenisation or model was prepared


def test_cli_trains_students_cut_from_the_teacher(tiny_llama, tmp_path):
    out = tmp_path / "run"
    students = (f"[{{name: cut_kd, init_from_teacher: {CUT}, loss: forward_kl}}, "
                "{name: layers_ce, init_from_teacher: {layers: [3, 0]}, loss: cross_entropy}, "
                "{name: random_ce, init: {num_hidden_layers: 1}, loss: cross_entropy}]")
    run_ranks(SCRIPT, _args(tiny_llama, out, students), nprocs=0)
    teacher = LlamaForCausalLM.from_pretrained(tiny_llama / "teacher")
    layers = LlamaForCausalLM.from_pretrained(out / "init/layers_ce")  # depth only: the teacher's layers 3 and 0
    for k, i in enumerate([3, 0]):
        for (name, got), want in zip(layers.model.layers[k].named_parameters(), teacher.model.layers[i].parameters(),
                                     strict=True):
            assert torch.equal(got, want), name
    cut = json.loads((out / "init/cut_kd/config.json").read_text())
    assert (cut["num_hidden_layers"], cut["hidden_size"], cut["intermediate_size"], cut["num_attention_heads"]) == \
        (2, 24, 20, 2)
    summary = json.loads((out / "report.json").read_text())["summary"]["students"]
    assert {name: row["init"] for name, row in summary.items()} == {
        "cut_kd": "teacher", "layers_ce": "teacher", "random_ce": "random"}
    assert "gap_closed" in summary["cut_kd"] and "gap_closed" in summary["layers_ce"]
    assert "gap_closed" not in summary["random_ce"]  # the baseline: random weights, no teacher
    assert AutoModelForCausalLM.from_pretrained(out / "students/cut_kd").config.hidden_size == 24
