"""The student as its own teacher (kind self): privileged rows, their alignment, the modes, the plan's refusals.

In-process: the data path's privileged prompts (``data/privileged.py``, ``chat.build_splits(privileged=...)``), the
teacher's log-probabilities on the student's tokens against a separate float64 forward of each privileged sequence
(padded and sampled rows), and the plan's refusals. One plain-python worker (``workers/self_teacher_scenarios.py``)
runs real DeepSpeed engines: what each mode holds, ``initial`` frozen, ``ema`` against the average by hand, and a
resumed ``ema`` run against the uninterrupted one.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import rank_results
import torch
import torch.nn.functional as F
from launch import ROOT, run_ranks
from tiny_models import llama_config, save_pair
from transformers import LlamaForCausalLM

from distill_kit import StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.data import chat, privileged
from distill_kit.data.blocks import DataConfig
from distill_kit.data.privileged import PrivilegedTemplate
from distill_kit.errors import ConfigError, DataError
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
