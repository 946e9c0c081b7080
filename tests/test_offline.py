"""Offline distillation on two real ranks: capture, train from the store, resume, refuse mismatches."""

from __future__ import annotations

import json
import re
import sys

import pytest
from launch import ROOT, run_ranks

WORKER = ROOT / "tests/workers/offline_scenarios.py"
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("offline")
    run_ranks(WORKER, [str(out), "offline_equals_online,resume,mismatches"], nprocs=2)
    return {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]
            for name in ("offline_equals_online", "resume", "mismatches")}


def test_full_vocabulary_store_trains_like_the_live_teacher(two_ranks):
    """k = V, float32 store, forward KL with the tail bucket plus a hidden-state term from a captured layer:
    the same student parameters and per-step losses as with the ZeRO-3 teacher, with no teacher weights."""
    for result in two_ranks["offline_equals_online"]:
        assert result["max_param_change"] > 1e-3
        assert result["max_param_diff"] < 1e-5
        assert result["losses"] == pytest.approx(result["online_losses"], rel=1e-5)
        assert result["teacher_parameters"] == 0
        assert result["same_teacher_identity"]
        assert set(result["rank_dirs"]) == {"rank00000", "rank00001"}  # each rank wrote its own parts
        # fp32 values (96 x 4) + uint8 ids (96) + fp32 tail (4), plus keys, offsets and file headers
        assert result["stats"]["top_k_bytes_per_token"] == 96 * 5 + 4


def test_capture_resumes_where_it_stopped(two_ranks):
    for result in two_ranks["resume"]:
        assert "incomplete" in result["incomplete_refused"] and "resumes" in result["incomplete_refused"]
        assert result["same_parts"] and result["same_content"] and result["complete"]
        assert result["kept_untouched"]  # finished parts are not redone
        assert "k: store 5, now 7" in result["other_k_refused"]


def test_store_from_other_inputs_is_refused_naming_both_values(two_ranks):
    for result in two_ranks["mismatches"]:
        assert "tokenizer: the store's is" in result["tokenizer"] and "this run's is" in result["tokenizer"]
        assert "dataset: the store's blocks are" in result["dataset"] and ":10, this run's are" in result["dataset"]
        assert "top 5 tokens per position, this run asks for 64" in result["k"]
        assert all(word in result["all"] for word in ("tokenizer:", "dataset:", "k:"))  # every difference at once
        assert result["none"] == ""
        assert "not in the teacher store" in result["unknown_sequence"]


def test_capture_script_refuses_bad_teacher_options_in_one_line(tmp_path, monkeypatch):
    """--teacher-options that are not YAML, or not a mapping: one line naming the flag, before anything is written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("capture_teacher", ROOT / "scripts/capture_teacher.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for options, message in (("{api: ", "--teacher-options: cannot read '{api: ' as YAML"),
                             ("[vllm]", "--teacher-options '[vllm]': give a mapping")):
        monkeypatch.setattr(sys, "argv", ["capture_teacher.py", "--teacher", "http://127.0.0.1:9", "--tokenizer",
                                          str(tmp_path), "--teacher-options", options, "--data", "x.txt", "--out",
                                          str(tmp_path / "store")])
        with pytest.raises(SystemExit, match=re.escape(message)):
            script.main()
    assert not (tmp_path / "store").exists()


def test_capture_script_stores_the_blocks_a_training_run_builds(tmp_path):
    """scripts/capture_teacher.py end to end under plain python: its store fits the blocks that
    ``data.build_splits`` gives a run with the same data settings, and reports its size per token."""
    import datasets
    from tiny_models import gpt2_config
    from transformers import GPT2LMHeadModel

    from distill_kit.data.blocks import DataConfig, build_splits
    from distill_kit.data.tokenizer import train_tokenizer
    from distill_kit.offline.captured_teacher import CapturedTeacher

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = train_tokenizer([f"def f{i}(x):\n    return x * {i}\n" for i in range(20)], vocab_size=300)
    tokenizer.save_pretrained(tokenizer_dir)
    GPT2LMHeadModel(gpt2_config(width=32, layers=2, vocab=len(tokenizer))).save_pretrained(tmp_path / "teacher")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n"}) + "\n"
                              for i in range(40)))
    data = DataConfig(train=str(corpus), block_size=32, heldout_fraction=0.1)
    run_ranks(ROOT / "scripts/capture_teacher.py",
              ["--teacher", str(tmp_path / "teacher"), "--tokenizer", str(tokenizer_dir), "--data", str(corpus),
               "--block-size", "32", "--heldout-fraction", "0.1", "--k", "16", "--hidden-layers", "2",
               "--micro-batch-size", "2", "--batches-per-part", "3", "--dtype", "fp32", "--out", str(tmp_path / "s")],
              nprocs=0)
    blocks = build_splits(data, tokenizer).train
    assert isinstance(blocks, datasets.Dataset)
    teacher = CapturedTeacher(tmp_path / "s", tokenizer=tokenizer, dataset=blocks, k=16)
    stats = teacher.reader.manifest.stats
    assert stats["blocks"] == len(blocks) == len(teacher.reader)
    assert stats["top_k_bytes_per_token"] == 16 * (2 + 2) + 2  # fp16 values, uint16 ids (300 ids), fp16 tail
    assert stats["bytes_per_token"] > stats["top_k_bytes_per_token"]  # + hidden states, keys, headers
