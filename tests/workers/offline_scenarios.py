"""Offline distillation on real ranks; launched by tests/test_offline.py.

Capture the tiny teacher into a store, then train the same student from the store and from the live
teacher on the same micro-batches. Each scenario writes ``<out>/<name>.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_scenarios import GAS, LENGTH, MBS, STEPS, STUDENT_CFG, TRAINING, gathered, rank_batches  # noqa: E402
from rank_results import saved_pair, write  # noqa: E402
from tiny_models import VOCAB, random_batches  # noqa: E402

from distill_kit import Distiller  # noqa: E402
from distill_kit.data.tokenizer import train_tokenizer  # noqa: E402
from distill_kit.engines import distributed  # noqa: E402
from distill_kit.offline.capture import CaptureConfig, capture  # noqa: E402
from distill_kit.offline.captured_teacher import CapturedTeacher, StoreMismatchError  # noqa: E402
from distill_kit.offline.store import MANIFEST, Manifest, parts  # noqa: E402

LOSS = [{"name": "forward_kl", "weight": 1.0}, {"name": "hidden_mse", "weight": 0.5, "layers": [[1, 3]]}]
FULL = CaptureConfig(k=VOCAB, values_dtype="fp32", hidden_layers=(3,), hidden_dtype="fp32", micro_batch_size=MBS,
                     batches_per_part=2, dtype="fp32")


def tiny_tokenizer():
    """A small byte-level BPE trained here: the store records its vocabulary, the token ids are random."""
    return train_tokenizer(["def f(x):\n    return x + 1\n"] * 4, vocab_size=300)



def blocks_of(batches: list[dict]) -> datasets.Dataset:
    """The micro-batches' sequences as the block dataset ``data.tokenize_to_blocks`` would give."""
    return datasets.Dataset.from_dict({name: torch.cat([b[name] for b in batches]).tolist()
                                       for name in ("input_ids", "attention_mask", "labels")})


def train(student: Path, teacher, batches: list[dict]) -> tuple[list[torch.Tensor], list[float], str]:
    distiller = Distiller(student, teacher, loss=LOSS, training=TRAINING, student_ds_config=STUDENT_CFG)
    history = distiller.train(batches)
    return gathered(distiller.student_model.parameters()), [h["loss"] for h in history], distiller.teacher_sha256


def offline_equals_online(out: Path, pair: tuple[Path, Path], tokenizer) -> None:
    """k = V in float32: training from the store gives the live teacher's parameters and losses."""
    teacher_dir, student_dir = pair
    world = distributed.world_size()
    all_batches = random_batches(STEPS * GAS * world, MBS, LENGTH, seed=7)
    blocks = blocks_of(all_batches)
    manifest = capture(teacher_dir, tokenizer, blocks, out / "store", FULL)
    mine = rank_batches(all_batches, distributed.rank(), world)
    online, online_losses, online_hash = train(student_dir, teacher_dir, mine)
    store = CapturedTeacher(out / "store", tokenizer=tokenizer, dataset=blocks, k=VOCAB)
    offline, offline_losses, offline_hash = train(student_dir, store, mine)
    initial = [p.detach() for p in GPT2LMHeadModel.from_pretrained(student_dir).parameters()]
    write(out, "offline_equals_online", {
        "max_param_diff": max((a - b).abs().max().item() for a, b in zip(offline, online, strict=True)),
        "max_param_change": max((a - b).abs().max().item() for a, b in zip(online, initial, strict=True)),
        "losses": offline_losses, "online_losses": online_losses,
        "stats": manifest.stats, "rank_dirs": sorted(p.parent.name for p in parts(out / "store")),
        "teacher_parameters": sum(p.numel() for p in store.parameters()),
        "same_teacher_identity": online_hash == offline_hash,  # what checkpoints record: resumable across modes
    })


def resume(out: Path, pair: tuple[Path, Path], tokenizer) -> None:
    """A capture that lost its last parts finishes by writing only those, with the same content."""
    teacher_dir, _ = pair
    blocks = blocks_of(random_batches(5, MBS, LENGTH, seed=11))  # 10 blocks: 5 micro-batches, 3 parts
    config = CaptureConfig(k=5, micro_batch_size=MBS, batches_per_part=2, dtype="fp32")
    store = out / "resume_store"
    capture(teacher_dir, tokenizer, blocks, store, config)
    before = {p: load_file(p) for p in parts(store)}
    kept = [p for p in before if p.name == "part-00000000.safetensors"]  # every rank's first part survives
    stamps = {p: os.stat(p).st_mtime_ns for p in kept}
    torch.distributed.barrier()
    if distributed.is_main():
        for path in set(before) - set(kept):
            path.unlink()
        manifest = Manifest.load(store)
        manifest.complete = False
        manifest.save(store)
    torch.distributed.barrier()
    with_gaps_refused = ""
    try:
        CapturedTeacher(store)
    except ValueError as err:
        with_gaps_refused = str(err)
    capture(teacher_dir, tokenizer, blocks, store, config)
    after = {p: load_file(p) for p in parts(store)}
    other_k = ""
    try:
        capture(teacher_dir, tokenizer, blocks, store, CaptureConfig(k=7, micro_batch_size=MBS, batches_per_part=2))
    except ValueError as err:
        other_k = str(err)
    write(out, "resume", {
        "same_parts": sorted(map(str, after)) == sorted(map(str, before)),
        "same_content": all(torch.equal(before[p][n], after[p][n]) for p in before for n in before[p]),
        "kept_untouched": all(os.stat(p).st_mtime_ns == stamps[p] for p in kept),
        "complete": json.loads((store / MANIFEST).read_text())["complete"],
        "incomplete_refused": with_gaps_refused, "other_k_refused": other_k,
    })


def mismatches(out: Path, tokenizer) -> None:
    """A store is refused for another tokenizer, dataset or k; every difference named with both values."""
    store = out / "resume_store"
    other_tokenizer = tiny_tokenizer()
    other_tokenizer.add_tokens(["<extra>"])
    other_blocks = blocks_of(random_batches(5, MBS, LENGTH, seed=12))
    messages = {}
    for name, kwargs in {"tokenizer": {"tokenizer": other_tokenizer}, "dataset": {"dataset": other_blocks},
                         "k": {"k": 64}, "all": {"tokenizer": other_tokenizer, "dataset": other_blocks, "k": 64},
                         "none": {"tokenizer": tokenizer, "k": 5}}.items():
        try:
            CapturedTeacher(store, **kwargs)
            messages[name] = ""
        except StoreMismatchError as err:
            messages[name] = str(err)
    unknown = ""
    try:
        CapturedTeacher(store)(**{k: v for k, v in other_blocks.with_format("torch")[:2].items() if k != "labels"})
    except KeyError as err:
        unknown = str(err)
    write(out, "mismatches", {**messages, "unknown_sequence": unknown})


def main() -> None:
    out = Path(sys.argv[1])
    scenarios = sys.argv[2].split(",")
    distributed.init()
    pair = saved_pair(out)
    tokenizer = tiny_tokenizer()
    if "offline_equals_online" in scenarios:
        offline_equals_online(out, pair, tokenizer)
    if "resume" in scenarios:
        resume(out, pair, tokenizer)
    if "mismatches" in scenarios:
        mismatches(out, tokenizer)


if __name__ == "__main__":
    main()
