"""combine: route on the data side: each conversation's teacher from its record, and the routed loader's schedule
(every rank forwards one and the same teacher at each micro-batch); the CLI end to end with two teachers."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from launch import ROOT, run_ranks
from test_chat_data import _chat_args, tiny_chat, tokenizer  # noqa: F401 - the chat CLI tests' fixtures
from test_cli import _main_error
from tiny_models import save_cli_teacher

from distill_kit.data import chat
from distill_kit.errors import DataError

NAMES = ["math", "code"]
SCRIPT = ROOT / "scripts/distill.py"


def conversations(teachers: list[str]) -> datasets.Dataset:
    """Tokenised conversations as the chat pipeline stores them: row i is i + 3 tokens, its answer counted."""
    rows = {name: [] for name in chat.ROUTED_FEATURES}
    for i, teacher in enumerate(teachers):
        ids = list(range(1, i + 4))
        rows["input_ids"].append(ids)
        rows["labels"].append([-100] + ids[1:])
        rows["length"].append(len(ids))
        rows["counted"].append(len(ids) - 1)
        rows["record"].append(f"data.jsonl record {i}")
        rows["teacher"].append(teacher)
    return datasets.Dataset.from_dict(rows, features=chat.ROUTED_FEATURES)


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_micro_batch_is_one_teacher_on_every_rank(drop_last):
    teachers = ["math"] * 11 + ["code"] * 6  # 17 rows; global batches of 2 ranks x 2 rows
    data = conversations(teachers)
    loaders = [chat.ChatLoader(data, 2, pad_id=0, rank=r, world_size=2, seed=3, drop_last=drop_last, route=NAMES)
               for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == (2 + 1 if drop_last else 3 + 2)  # math 2 (+1 partial), code 1 (+1)
    counted = {name: 0 for name in NAMES}
    for _epoch in range(2):
        seen = []
        for batches in zip(*loaders, strict=True):
            ids = torch.cat([b["teacher_id"] for b in batches])
            assert len(set(ids.tolist())) == 1  # one teacher across the ranks: one forward, no waiting rank
            for b in batches:
                for row, labels in zip(b["input_ids"], b["labels"], strict=True):
                    if (labels != -100).any():
                        index = int((row != 0).sum()) - 3  # the row's length gives it away
                        seen.append(index)
                        assert teachers[index] == NAMES[ids[0]]  # every row goes to the teacher its record names
                        counted[teachers[index]] += int((labels != -100).sum())
        assert len(seen) == len(set(seen))  # no row twice in an epoch (fillers count nothing)
        if not drop_last:
            assert sorted(seen) == list(range(len(teachers)))  # evaluation: every row once
        else:
            assert len(seen) == 4 * len(loaders[0])  # training: whole global batches only
    assert counted["math"] > 0 and counted["code"] > 0


def test_a_record_naming_no_teacher_of_the_run_is_refused_naming_it():
    with pytest.raises(DataError, match=r"data.jsonl record 2: teacher 'poetry' is not one of the run's teachers "
                                        r"\['math', 'code'\]"):
        chat.ChatLoader(conversations(["math", "code", "poetry", "math"]), 1, pad_id=0, route=NAMES)
    with pytest.raises(DataError, match=r"record 7: no 'teacher' naming its teacher, and combine: route"):
        chat.record_teacher({"messages": []}, "record 7", "teacher")


def test_the_cli_distils_one_student_from_two_routed_teachers(tiny_chat, tokenizer, tmp_path):  # noqa: F811
    """Records naming their teacher under data.teacher_field; two teachers of one tokenizer; the run trains,
    evaluates and reports both teachers. A record naming another teacher is one clear error before any write."""
    root = tmp_path / "routed"
    root.mkdir()
    for split in ("train", "heldout"):
        records = [json.loads(line) for line in (tiny_chat["root"] / f"{split}.jsonl").read_text().splitlines()]
        with (root / f"{split}.jsonl").open("w") as handle:
            for i, record in enumerate(records):
                handle.write(json.dumps(record | {"domain": NAMES[i % 2]}) + "\n")
    second = save_cli_teacher(tmp_path / "second", tokenizer)
    args = [a for a in _chat_args(tiny_chat, tmp_path / "run") if not a.startswith(("teacher=", "data.train=",
                                                                                    "data.heldout="))]
    args = [*args[:-2], "--students", "[{name: s, init: {n_layer: 1, n_embd: 32}}]",
            f"data.train={root / 'train.jsonl'}", f"data.heldout={root / 'heldout.jsonl'}",
            "data.teacher_field=domain", "combine=route",
            "--teachers", f"[{{name: math, model: {tiny_chat['teacher']}}}, {{name: code, model: {second}}}]"]
    run_ranks(SCRIPT, args, nprocs=0)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [t["name"] for t in report["teachers"]] == NAMES
    assert [e["step"] for e in report["evaluations"]] == [2, 4] and "s" in report["summary"]["students"]
    bad = root / "bad.jsonl"
    bad.write_text((root / "train.jsonl").read_text().replace('"domain": "code"', '"domain": "poetry"', 1))
    bad_args = [f"data.train={bad}" if a.startswith("data.train=") else a for a in args]
    message = _main_error(*bad_args, f"output_dir={tmp_path / 'bad_run'}")
    assert "teacher 'poetry' is not one of the run's teachers ['math', 'code']" in message
    assert not (tmp_path / "bad_run").exists()
