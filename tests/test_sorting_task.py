"""The sorting task (generator, exact checker, the arithmetic task's tokenizer), its shipped teacher, and a tiny run
of the routed two-task comparison (benchmarks/bench_routed_tasks.py: two steps a row)."""

from __future__ import annotations

import json
import sys

import pytest
from launch import ROOT, run_ranks
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill_kit.data import chat
from distill_kit.data.blocks import DataConfig
from distill_kit.tasks import arithmetic, sorting
from distill_kit.tasks.evaluate import exact_match

TEACHERS = {name: ROOT / "distill_kit/assets" / name / "teacher" for name in ("arithmetic", "sorting")}


def test_examples_are_seeded_and_the_checker_is_exact():
    first = list(sorting.examples(3, 200))
    assert first == list(sorting.examples(3, 200)) and first != list(sorting.examples(4, 200))
    for item in first:
        assert len(item.prompt) == sorting.DIGITS and item.prompt.isdigit()
        assert sorting.check(item.prompt, item.answer) and sorting.check(item.prompt, f" {item.answer}\n")
        assert not sorting.check(item.prompt, item.answer[:-1])  # a digit short
        assert not sorting.check(item.prompt, item.answer + "9")  # a digit too many
        if len(set(item.prompt)) > 1:
            assert not sorting.check(item.prompt, item.answer[::-1])  # the same digits, out of order
    assert sorting.check("52819374", "12345789") and not sorting.check("52819374", "12345788")
    assert not sorting.check("10000000", "00000000")  # a digit replaced
    seeds = [sorting.split_seeds(s).values() for s in range(3)] + [arithmetic.split_seeds(s).values() for s in range(3)]
    assert len({x for group in seeds for x in group}) == sum(len(group) for group in seeds)  # no stream shared


def test_routed_records_encode_as_the_chat_pipeline_does(tmp_path):
    """Sorting records naming their teacher: the chat pipeline's ids and labels equal the hand encoding (one id a
    character, answer and end token counted), and the routed loader gives each row its record's teacher."""
    tokenizer = sorting.build_tokenizer()
    items = {name: list(task.examples(1, 10)) for name, task in (("arithmetic", arithmetic), ("sorting", sorting))}
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"prompt": i.prompt, "completion": i.answer, "teacher": name}) + "\n"
                            for name, drawn in items.items() for i in drawn))
    splits = chat.build_splits(DataConfig(train=str(path), heldout=str(path), format="chat", block_size=64),
                               tokenizer, route=True)
    for item, row in zip(items["arithmetic"] + items["sorting"], splits.train, strict=True):
        assert (list(row["input_ids"]), list(row["labels"])) == sorting.encode(tokenizer, item)
    assert list(splits.train["teacher"]) == ["arithmetic"] * 10 + ["sorting"] * 10
    loader = chat.ChatLoader(splits.train, 5, pad_id=tokenizer.pad_token_id, route=["arithmetic", "sorting"])
    for batch in loader:
        assert len(set(batch["teacher_id"].tolist())) == 1


def test_the_shipped_sorting_teacher_sorts_and_shares_the_arithmetic_tokenizer():
    tokenizers = {name: AutoTokenizer.from_pretrained(path) for name, path in TEACHERS.items()}
    assert tokenizers["sorting"].get_vocab() == tokenizers["arithmetic"].get_vocab()
    assert tokenizers["sorting"].chat_template == arithmetic.CHAT_TEMPLATE
    teacher = AutoModelForCausalLM.from_pretrained(TEACHERS["sorting"])
    heldout = list(sorting.examples(sorting.split_seeds(0)["heldout"], 100))
    assert exact_match(teacher, tokenizers["sorting"], heldout, 12, check=sorting.check) == 1.0
    record = json.loads((TEACHERS["sorting"] / "training.json").read_text())
    assert record["final_exact_match"] == 1.0 and "--task sorting" in record["command"]


def test_the_routed_two_task_comparison_runs(tmp_path):
    """Every row of benchmarks/bench_routed_tasks.py on a handful of examples and two steps a row."""
    run_ranks(ROOT / "benchmarks/bench_routed_tasks.py",  # in this process (launch.run_here); a failure fails here
              ["--out", str(tmp_path / "run"), "--steps", "3", "--warm-start-steps", "1", "--micro-batch", "4",
               "--labelled", "8", "--prompts", "8", "8", "--heldout", "8", "--seeds", "3"], nprocs=0)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    rows = {row["row"]: row for row in report["rows"]}
    assert list(rows) == ["teacher:arithmetic", "teacher:sorting", "sft", "only_arithmetic", "only_sorting", "routed"]
    assert rows["teacher:arithmetic"]["arithmetic"] == 1.0 and rows["teacher:sorting"]["sorting"] == 1.0
    assert report["seeds"] == [3] and (tmp_path / "run" / "seed_3" / "data").is_dir()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_routed_tasks import aggregate

    per_seed = [{"seed": s, "rows": [{"row": "routed", "arithmetic": a, "sorting": b, "train_seconds": 2.0}]}
                for s, a, b in ((0, 0.9, 0.5), (1, 0.7, 0.6), (2, 0.8, 0.4))]
    (row,) = aggregate(per_seed)  # the table's figures: each seed's values, summarised per task
    assert row["arithmetic"] == pytest.approx(0.8) and row["arithmetic_per_seed"] == [0.9, 0.7, 0.8]
    assert (row["sorting_min"], row["sorting_max"]) == (0.4, 0.6) and row["train_seconds"] == 2.0
    assert all(0 <= row[task] <= 1 for row in rows.values() for task in ("arithmetic", "sorting"))
