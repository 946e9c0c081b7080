"""The student as its own teacher (kind self): privileged rows, their alignment, the modes, the plan's refusals.

In-process: the data path's privileged prompts (``data/privileged.py``, ``chat.build_splits(privileged=...)``), the
teacher's log-probabilities on the student's tokens against a separate float64 forward of each privileged sequence
(padded and sampled rows), the plan's refusals, and the CLI: docs/teachers.md's run config as printed (a report;
``ema`` stopped and resumed equals the uninterrupted run) and its refusals, one line each before any write. One
plain-python worker (``workers/self_teacher_scenarios.py``) runs real DeepSpeed engines: what each mode holds,
``initial`` frozen, ``ema`` against the average by hand, and a resumed ``ema`` run against the uninterrupted one.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import rank_results
import torch
import torch.nn.functional as F
import yaml
from launch import ROOT, run_ranks
from test_cli import _main_error  # the CLI's error message, caught in this process
from tiny_models import llama_config, save_pair
from transformers import LlamaForCausalLM

from distill_kit import StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.data import chat, privileged
from distill_kit.data.blocks import DataConfig
from distill_kit.data.privileged import PrivilegedTemplate
from distill_kit.errors import ConfigError, DataError
from distill_kit.run import cli, run_config
from distill_kit.tasks import arithmetic
from distill_kit.teachers.self_teacher import SelfTeacher
from distill_kit.training.on_policy import splice
from distill_kit.training.plan import DataFacts, make_plan

WORKER = ROOT / "tests/workers/self_teacher_scenarios.py"
ANSWER = {"role": "user", "content": "{completion}"}


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def splits(tmp_path, records, template, **data):
    tokenizer = arithmetic.build_tokenizer()
    train = write_records(tmp_path / "train.jsonl", records)
    config = DataConfig(train=train, heldout=train, format="chat", block_size=64, **data)
    return tokenizer, chat.build_splits(config, tokenizer, privileged=PrivilegedTemplate.parse(template, "t"))


# ---- the data path --------------------------------------------------------------------------------------------


def test_privileged_prompt_is_the_template_rendering_before_the_answer(tmp_path):
    records = [{"prompt": "12+3", "completion": "12+3=15#15", "hint": "15"}, {"prompt": "40-1", "hint": "39"}]
    tokenizer, split = splits(tmp_path, records, {"role": "user", "content": "{prompt}#{hint}"})
    rows = split.train

    def rendered(content: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    first = rendered("12+3#15")
    assert rows[0]["privileged"] == first  # the prompt only: the answer is the student row's
    assert rows[1]["privileged"] == rendered("40-1#39")  # a prompt alone: all of it
    batch = chat.ChatLoader(rows.select([0]), 1, pad_id=0, shuffle=False).batch(0, 0)
    assert batch["privileged_input_ids"][0, :batch["privileged_lengths"][0]].tolist() == first


def test_a_record_without_a_named_field_is_refused_naming_it(tmp_path):
    with pytest.raises(DataError, match=r"record 1 .*\['hint'\]"):
        splits(tmp_path, [{"prompt": "1+2", "completion": "1+2=3#3", "hint": "3"},
                          {"prompt": "2+2", "completion": "2+2=4#4"}], "{prompt}#{hint}")


def test_templates_and_options_are_checked():
    for bad, match in [({"content": "{prompt"}, "valid str.format"), ({"content": "x", "role": "assistant"}, "role"),
                       ({"content": "{a.b}"}, "plain names"), ({"content": "x", "where": 1}, "not keys"), (3, "give")]:
        with pytest.raises(ConfigError, match=match):
            PrivilegedTemplate.parse(bad, "k")
    assert PrivilegedTemplate.parse("{prompt} {completion}", "k").fields() == ["prompt", "completion"]
    for options, match in [({"mode": "frozen", "privileged": "x"}, "mode"), ({"privileged": "x", "decay": 0.9},
                           "decay is read by mode: ema"), ({"mode": "ema", "decay": 1.0, "privileged": "x"}, "decay"),
                           ({"mode": "live"}, "privileged")]:
        with pytest.raises(ConfigError, match=match):
            SelfTeacher.describe(TeacherSpec(name="self", kind="self", options=options))


def test_a_template_that_changes_the_answer_is_refused():
    template = PrivilegedTemplate("{content}")
    with pytest.raises(ConfigError, match="after its first counted answer"):
        privileged.privileged_prompt([1, 2, 3, 4], [-100, -100, 3, 4], [1, 5, 3, 9], [-100, -100, 3, 9], "r")
    assert privileged.privileged_prompt([1, 2, 3], [-100, 2, 3], [7, 7, 7, 2, 3], [-100] * 3 + [2, 3], "r") == [7] * 3
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}]
    added = PrivilegedTemplate("hint {h}", role="system", replace=False).messages({"h": "1"}, messages, 2, "r")
    assert [m["content"] for m in added] == ["hint 1", "s", "q", "a"]
    replaced = template.messages({}, messages, 2, "r")
    assert replaced == messages


# ---- the teacher's rows and log-probabilities -------------------------------------------------------------------


def float64_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config()).double().eval()


def live_teacher(model) -> SelfTeacher:
    spec = TeacherSpec(name="self", kind="self", options={"mode": "live", "privileged": ANSWER})
    teacher = SelfTeacher(spec, SelfTeacher.describe(spec), setup=None)
    teacher.attach({"s": SimpleNamespace(model=model)})
    return teacher


def chat_rows(seed: int):
    """Three rows of another prompt length each (one prompt alone), right-padded; each with a privileged prompt."""
    generator = torch.Generator().manual_seed(seed)
    rows = [(torch.randint(1, 96, (n,), generator=generator), torch.randint(1, 96, (a,), generator=generator),
             torch.randint(1, 96, (q,), generator=generator)) for n, a, q in ((3, 6, 11), (9, 4, 2), (5, 0, 7))]
    ids, labels = [torch.cat([p, a]).tolist() for p, a, _ in rows], [[-100] * len(p) + a.tolist() for p, a, _ in rows]
    return chat.pad_rows(ids, labels, 0) | privileged.pad_prompts([q.tolist() for *_, q in rows], 0), rows


def separate_logprobs(model, prompt: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``answer``'s tokens after ``prompt``, from one unpadded forward of the two."""
    with torch.no_grad():
        logits = model(torch.cat([prompt, answer])[None]).logits[0].double()
    return F.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, answer[:, None]).squeeze(1)


def teacher_logprobs(teacher, batch, row: int) -> torch.Tensor:
    out = teacher.forward(batch)
    positions = (batch["labels"][row] != -100).nonzero().squeeze(1) - 1  # position t predicts token t + 1
    tokens = batch["input_ids"][row, positions + 1]
    return F.log_softmax(out.logits[row, positions].double(), -1).gather(-1, tokens[:, None]).squeeze(1)


def test_teacher_scores_the_students_answer_as_a_separate_forward_of_the_privileged_sequence():
    model = float64_llama()
    teacher = live_teacher(model)
    batch, rows = chat_rows(0)
    assert teacher.forward(batch).logits.shape[:2] == batch["input_ids"].shape  # the student's layout
    for i, (_, answer, prompt) in enumerate(rows):
        if len(answer):
            torch.testing.assert_close(teacher_logprobs(teacher, batch, i), separate_logprobs(model, prompt, answer),
                                       rtol=0, atol=1e-12)
    # the rows the teacher forwarded: privileged prompt, then the student's answer; padding after
    made = privileged.teacher_rows(batch, 0)
    for i, (_, answer, prompt) in enumerate(rows):
        n = len(prompt) + len(answer)
        assert made.input_ids[i, :n].tolist() == torch.cat([prompt, answer]).tolist()
        assert made.attention_mask[i].sum() == n


def test_a_sample_replaces_the_answer_in_both_rows():
    """On-policy: the sampler splices the sample after the plain prompt; the teacher reads it after its own."""
    model = float64_llama()
    teacher = live_teacher(model)
    batch, rows = chat_rows(1)
    sample = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    prompt_of_row2 = rows[2][0]
    sampled = splice(batch, torch.tensor([2]), [prompt_of_row2], [sample], pad=0)
    assert torch.equal(sampled["privileged_input_ids"], batch["privileged_input_ids"])  # kept as they were
    torch.testing.assert_close(teacher_logprobs(teacher, sampled, 2), separate_logprobs(model, rows[2][2], sample),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(teacher_logprobs(teacher, sampled, 0), separate_logprobs(model, rows[0][2],
                                                                                        rows[0][1]), rtol=0, atol=1e-12)


def test_packed_rows_and_missing_prompts_are_refused():
    teacher = live_teacher(float64_llama())
    batch, _ = chat_rows(2)
    with pytest.raises(ConfigError, match="packing"):
        teacher.forward({**batch, "position_ids": batch["input_ids"], "attention_mask": None})
    with pytest.raises(ConfigError, match="privileged template"):
        teacher.forward({k: v for k, v in batch.items() if not k.startswith("privileged")})


# ---- the plan ---------------------------------------------------------------------------------------------------


def test_the_plan_refuses_what_a_self_teacher_cannot_serve(tmp_path):
    _, student = save_pair(tmp_path)
    self_teacher = TeacherSpec(name="self", kind="self", options={"mode": "ema", "privileged": ANSWER})
    one = [StudentSpec(name="a", model=str(student))]
    two = one + [StudentSpec(name="b", model=str(student))]
    with pytest.raises(ConfigError) as refused:
        make_plan(two, [self_teacher], training=TrainingConfig(), world_size=1, data=DataFacts(kind="text"))
    assert "2 students" in str(refused.value) and "not chat" in str(refused.value)
    with pytest.raises(ConfigError, match="packing"):
        make_plan(one, [self_teacher], training=TrainingConfig(), world_size=1,
                  data=DataFacts(kind="chat", packing=True, block_size=32))
    plan = make_plan(one, [self_teacher], training=TrainingConfig(), world_size=1, data=DataFacts(kind="chat"))
    assert plan.cards["self"].kind == "self" and not plan.cards["self"].engine and not plan.head_at_loss["self"]


# ---- real engines: memory, modes, resume -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("self_teacher")
    run_ranks(WORKER, [str(out), "memory,frozen_and_average,resume"], nprocs=0)
    return rank_results.read(out, 1)


def test_live_holds_no_copy_initial_and_ema_one(engines):
    memory = engines["memory"][0]
    assert memory["live"]["teacher_is_student"] and memory["live"]["teacher_bytes_beyond_student"] == 0
    for mode in ("initial", "ema"):
        assert memory[mode]["teacher_bytes_beyond_student"] == memory[mode]["student_bytes"]
    assert memory["initial"]["engine_bytes_beyond_both"] == 0
    assert memory["ema"]["engine_bytes_beyond_both"] == 8  # the average is the copy itself (float32), + its counter


def test_initial_stays_frozen_and_ema_is_the_average_by_hand(engines):
    result = engines["frozen_and_average"][0]
    assert result["initial_drift"] == 0.0 and result["student_change"] > 1e-3
    assert result["ema_steps"] == 4
    assert result["ema_vs_hand"] == 0.0  # the same float32 lerp, step by step
    assert result["ema_vs_formula"] < 1e-6  # decay * ema + (1 - decay) * student in float64
    assert result["ema_distance_to_student"] > 1e-4  # it lags the student


def test_resumed_ema_run_equals_the_uninterrupted_one(engines):
    result = engines["resume"][0]
    assert result["resumed_from"].endswith("step_00000002")
    assert result["losses"] == result["ref_losses"]
    assert result["student_diff"] == 0.0 and result["ema_diff"] == 0.0
    assert result["ema_steps"] == [4, 4] and result["ema_moved"] > 0


# ---- the CLI: the docs' run config ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_run(tmp_path_factory) -> dict:
    """docs/teachers.md's self-teacher YAML as printed, its student and data pointed at a tiny Llama over the
    arithmetic task's tokenizer (the template's other characters read as its unknown token) and chat records."""
    root = tmp_path_factory.mktemp("self_cli")
    tokenizer = arithmetic.build_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(vocab_size=len(tokenizer), num_hidden_layers=1, max_position_embeddings=128,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=tokenizer.eos_token_id)).save_pretrained(root / "student")
    tokenizer.save_pretrained(root / "student")
    sums = [(a, b) for a in (3, 17, 40) for b in (5, 26, 8, 31)]
    records = [{"prompt": f"{a}+{b}", "completion": str(a + b)} for a, b in sums]
    train = write_records(root / "train.jsonl", records[:8])
    heldout = write_records(root / "heldout.jsonl", records[8:])
    blocks = re.findall(r"^```yaml\n(.*?)^```", (ROOT / "docs/teachers.md").read_text(), flags=re.S | re.M)
    (block,) = [b for b in blocks if "kind: self" in b]
    config = yaml.safe_load(block)
    config["students"][0]["model"], config["data"]["train"] = str(root / "student"), train
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    return {"root": root, "config": config, "args": [f"data.heldout={heldout}", "data.block_size=64",
                                                      "training.micro_batch_size=2", "training.lr=1e-2",
                                                      "training.on_policy.max_new_tokens=4", "eval.every=2",
                                                      "report_to=[]"]}


def _cli_run(docs_run: dict, out, steps: int, resume: bool = False):
    overrides = [*docs_run["args"], f"output_dir={out}", f"training.max_steps={steps}"]
    return cli.run(run_config.load(docs_run["root"] / "run.yaml", overrides), resume=resume)


def _average(out) -> dict[str, torch.Tensor]:
    """The last checkpoint's student module: the student's weights and the ``ema`` average (its buffers)."""
    (last,) = sorted((out / "checkpoints").glob("step_*"))[-1:]
    return torch.load(last / "student" / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def test_the_docs_run_config_runs_through_the_cli_and_a_resumed_ema_run_equals_the_uninterrupted_one(docs_run):
    """The docs' YAML (mode ema, on-policy, the privileged template) runs: report, evaluations against the self
    teacher, exported student. Stopped after 2 steps and resumed to 4: the same records, average and student."""
    assert docs_run["config"]["teachers"][0]["options"]["mode"] == "ema"
    whole, split = docs_run["root"] / "whole", docs_run["root"] / "split"
    summary = _cli_run(docs_run, whole, 4)
    assert summary["students"]["student"]["perplexity"] > 1 and summary["teacher_perplexity"] > 1
    report = json.loads((whole / "report.json").read_text())
    (teacher,) = report["teachers"]
    assert teacher["model"] is None and teacher["sha256"].startswith("self:ema:0.99:template=")
    assert [e["step"] for e in report["evaluations"]] == [2, 4]
    _cli_run(docs_run, split, 2)
    _cli_run(docs_run, split, 4, resume=True)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (split / name).read_text() == (whole / name).read_text()
    expected, got = _average(whole), _average(split)
    assert int(got["self_teacher_self.steps"]) == 4 and expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected)
    exported = (whole / "students" / "student" / "model.safetensors").read_bytes()
    assert (split / "students" / "student" / "model.safetensors").read_bytes() == exported


@pytest.mark.parametrize(("extra", "message"), [
    (["--teachers", "[{name: self, kind: self, model: x, options: {privileged: '{prompt}'}}]"],
     "config error: teachers[self].model: a self-teacher is the student itself and reads no model ('x'): drop model"),
    (["--teachers", "[{name: self, kind: self, options: {privileged: '{prompt} {hint}'}}]"],
     "the privileged template names ['hint'], and this record has no such field (it has ['completion', 'prompt'])"),
    (["data.format=text", "training.on_policy.fraction=0"],
     "config error: teachers[self] (kind self) reads a privileged prompt made from each chat record, and the data"),
    (["data.packing=true"], "config error: teachers[self] (kind self): data.packing with a self-teacher"),
])
def test_the_cli_refuses_what_a_self_teacher_cannot_run_in_one_line_before_any_write(docs_run, tmp_path, extra,
                                                                                      message):
    out = tmp_path / "run"
    got = _main_error("--config", str(docs_run["root"] / "run.yaml"), *docs_run["args"], f"output_dir={out}", *extra)
    assert message in got and "\n" not in got, got
    assert not out.exists()
