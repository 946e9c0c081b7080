"""``benchmarks/drafter_grid.py`` at a tiny budget on the CPU, in-process: the teacher's-text rows train on the
teacher's own greedy continuations (each row's prompt kept, labels on the continuation only), and a cell writes tau
for each of its drafters within [1, gamma + 1]. Nothing about which objective wins: that is the grid's run."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch
from launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import drafter_grid  # noqa: E402


@pytest.mark.slow  # the embedded corpus tokenised, a DeepSpeed student engine, a few steps: ~30 s, off the fast tier
def test_teacher_text_rows_and_a_cell(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    argv = ["--steps", "2", "--train-blocks", "16", "--prompts", "2", "--new-tokens", "4", "--prompt", "8",
            "--continuation", "6", "--batch", "4", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out")]
    args = argparse.Namespace(
        task="default", cache=str(tmp_path / "cache"), prompt=8, continuation=6, train_blocks=16, prompts=2, batch=4)
    teacher = AutoModelForCausalLM.from_pretrained(drafter_grid.DEFAULT_TEACHER, dtype=torch.float32).eval()
    rows = drafter_grid.default_rows(args, AutoTokenizer.from_pretrained(drafter_grid.DEFAULT_TEACHER))
    text = drafter_grid.on_teacher_text(rows, teacher, args, torch.device("cpu"))
    assert len(text.split) == len(rows.split.train)
    first = rows.split.train[0]["input_ids"][:8]
    greedy = teacher.generate(torch.tensor([first]), attention_mask=torch.ones(1, 8, dtype=torch.long),
                              do_sample=False, max_new_tokens=6, min_new_tokens=6, eos_token_id=None,
                              pad_token_id=0)[0].tolist()
    assert text.split[0]["input_ids"] == greedy
    assert text.split[0]["labels"] == [-100] * 8 + greedy[8:]
    batch = next(text.batches(0))
    assert batch["input_ids"].shape == (4, 14)

    drafter_grid.main([*argv, "--rows", "teacher_text_fkl", "teacher_text_tv", "--cell", "teacher_text", "0"])
    figures = json.loads((tmp_path / "out" / "cells" / "teacher_text_s0.json").read_text())["figures"]
    assert set(figures) == {"teacher_text_fkl", "teacher_text_tv"}
    assert all(1.0 <= row["tau"] <= 5.0 for row in figures.values())
