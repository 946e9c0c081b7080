"""LoRA (PEFT) students on real ranks; launched by tests/test_peft.py.

One launch runs every scenario (each launch pays DeepSpeed's start-up). Each writes ``<out>/<name>.rank<r>.json``;
the pytest side asserts on those numbers.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import peft
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import plain_adamw, plain_kl, plain_step, saved_model, saved_pair, write  # noqa: E402
from tiny_models import random_batches  # noqa: E402

from distill_kit import Distiller, TrainingConfig  # noqa: E402
from distill_kit.engines import distributed, peft_student  # noqa: E402
from distill_kit.training.export import export_student  # noqa: E402

STEPS, GAS, MBS, LENGTH = 4, 2, 2, 24
TRAINING = TrainingConfig(max_steps=STEPS, micro_batch_size=MBS, gradient_accumulation_steps=GAS,
                          lr=1e-2, weight_decay=0.01, max_grad_norm=0.5, lr_schedule="constant", log_every=100)
ADAPTERS = {"r": 4, "alpha": 8.0, "target_modules": ["c_attn", "c_fc"]}


def rank_batches(all_batches: list[dict], rank: int, world: int) -> list[dict]:
    """Step s uses global micro-batches [s*world*GAS, (s+1)*world*GAS); rank r takes its GAS of them."""
    return [all_batches[(s * world + rank) * GAS + m] for s in range(STEPS) for m in range(GAS)]


def adapters(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().to(dtype) for n, p in model.named_parameters() if p.requires_grad}


def frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def reference(student_dir: Path, teacher_dir: Path, start: dict[str, torch.Tensor], all_batches: list[dict],
              world: int, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch: the same LoRA model (peft) started from the engine's initial adapters; torch AdamW over the
    adapters alone at a constant lr, clipped; the forward KL over the union of every rank's micro-batches; in
    ``dtype`` (float64: the trajectory without float32's rounding, tests/tolerances.py)."""
    model = peft.get_peft_model(GPT2LMHeadModel.from_pretrained(student_dir),
                                peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=["c_attn", "c_fc"])).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(start[name])
    teacher = GPT2LMHeadModel.from_pretrained(teacher_dir).to(dtype).eval()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = plain_adamw(trained, TRAINING)
    losses = []
    for s in range(STEPS):
        total, tokens = 0.0, 0
        for b in all_batches[s * world * GAS:(s + 1) * world * GAS]:
            kl, counted = plain_kl(model, teacher, b)
            total, tokens = total + kl, tokens + counted
        loss = total / tokens
        losses.append(plain_step(opt, loss, TRAINING.max_grad_norm))
    return adapters(model, dtype), losses


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def lora_trains(out: Path, teacher_dir: Path, student_dir: Path) -> None:
    """The engine against the plain loop; what the optimizer holds; the frozen base untouched."""
    world = distributed.world_size()
    all_batches = random_batches(STEPS * GAS * world, MBS, LENGTH, seed=7)
    distiller = Distiller(student_dir, teacher_dir, training=TRAINING, peft=ADAPTERS)
    start, base = adapters(distiller.student_model), frozen(distiller.student_model)
    history = distiller.train(rank_batches(all_batches, distributed.rank(), world))
    optimizer = distiller.student.optimizer
    ref, ref_losses = reference(student_dir, teacher_dir, start, all_batches, world)
    exact, _ = reference(student_dir, teacher_dir, start, all_batches, world, dtype=torch.float64)
    ours = adapters(distiller.student_model)
    write(out, "lora_trains", {
        "max_param_diff": max_diff(ours, ref),
        "max_param_change": max_diff(ours, start),
        "ours_vs_float64": max((ours[k].double() - exact[k]).abs().max().item() for k in ours),
        "ref_vs_float64": max((ref[k].double() - exact[k]).abs().max().item() for k in ours),
        "base_change": max_diff(frozen(distiller.student_model), base),
        "losses": [h["loss"] for h in history], "ref_losses": ref_losses,
        "counts": peft_student.parameter_counts(distiller.student.module),
        "optimizer_partition": sum(p.numel() for p in optimizer.single_partition_of_fp32_groups),
        "adam_state": {k: sum(v.numel() for s in optimizer.optimizer.state.values() for key, v in s.items()
                              if key == k) for k in ("exp_avg", "exp_avg_sq")},
        "trained_names": sorted({n.split(".")[-2] for n in ours}),
    })


def resume_and_export(out: Path, teacher_dir: Path, student_dir: Path, other_student_dir: Path) -> None:
    """Stopped at step 2 and resumed = uninterrupted; the checkpoint holds adapters only; the merged export
    loads with AutoModelForCausalLM and gives the engine's logits; another base is refused."""
    data = random_batches(STEPS * GAS, MBS, LENGTH, seed=20 + distributed.rank())
    spec = dict(ADAPTERS, export_merged=True)
    whole = Distiller(student_dir, teacher_dir, training=TRAINING, peft=spec)
    whole_history = whole.train(data)
    training = replace(TRAINING, checkpoint_dir=str(out / "ckpt"), save_every=2)
    first = Distiller(student_dir, teacher_dir, training=training, peft=spec)
    first.train(data, until=2)
    del first
    resumed = Distiller(student_dir, teacher_dir, training=training, peft=spec)
    resumed_from = resumed.resume()
    resumed_history = resumed.train(data)
    module_keys = []
    if distributed.is_main():
        states = torch.load(out / "ckpt/step_00000002/deepspeed/mp_rank_00_model_states.pt", weights_only=False)
        module_keys = sorted(states["module"])

    other = Distiller(other_student_dir, teacher_dir, training=training, peft=spec)
    try:
        other.resume()
        refusal = None
    except ValueError as err:
        refusal = str(err)

    export_student(resumed.student_model, out / "export", merged=resumed.export_merged)
    batch = data[0]
    resumed.student.eval()
    with torch.no_grad():
        engine_logits = resumed.student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    merged = AutoModelForCausalLM.from_pretrained(out / "export/merged").eval()
    base = GPT2LMHeadModel.from_pretrained(student_dir)
    adapter = peft.PeftModel.from_pretrained(base, out / "export").eval()
    with torch.no_grad():
        merged_logits = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        adapter_logits = adapter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    write(out, "resume_and_export", {
        "resumed_from": Path(resumed_from).name,
        "whole_losses": [h["loss"] for h in whole_history][2:], "resumed_losses": [h["loss"] for h in resumed_history],
        "resumed_diff": max_diff(adapters(resumed.student_model), adapters(whole.student_model)),
        "module_keys": module_keys,
        "tied_head": resumed.student_model.get_output_embeddings().weight
        is resumed.student_model.get_input_embeddings().weight,
        "refusal": refusal,
        "export_files": sorted(p.name for p in (out / "export").iterdir()),
        "merged_has_lora": any("lora" in n for n, _ in merged.named_parameters()),
        "merged_vs_engine": (merged_logits - engine_logits).abs().max().item(),
        "adapter_vs_engine": (adapter_logits - engine_logits).abs().max().item(),
    })


def feature_losses(out: Path, teacher_dir: Path, student_dir: Path) -> None:
    """Hidden-state and attention losses on a PEFT student: at step 1 the adapters are the identity (LoRA's B
    starts at 0), so every part equals the same loss on the plain student; then the adapters and the hidden
    projection train."""
    loss = [{"name": "forward_kl", "weight": 1.0}, {"name": "hidden_mse", "weight": 1.0},
            {"name": "attention_kl", "weight": 1.0}]
    data = random_batches(2 * GAS, MBS, LENGTH, seed=30 + distributed.rank())
    training = replace(TRAINING, max_steps=2)
    lora = Distiller(student_dir, teacher_dir, loss=loss, training=training, peft=ADAPTERS)
    start = adapters(lora.student.module)
    lora_history = lora.train(data)
    plain = Distiller(student_dir, teacher_dir, loss=loss, training=training)
    plain_history = plain.train(data)
    trained = adapters(lora.student.module)
    write(out, "feature_losses", {
        "lora_first": lora_history[0], "plain_first": plain_history[0], "lora_last": lora_history[-1],
        "projection_change": max((trained[k] - start[k]).abs().max().item() for k in trained if "projection" in k),
        "adapter_change": max((trained[k] - start[k]).abs().max().item() for k in trained if "lora_B" in k),
    })


def main() -> None:
    out = Path(sys.argv[1])
    distributed.init()
    teacher_dir, student_dir = saved_pair(out)
    other_student_dir = saved_model(out, "other_student", seed=99, width=32, layers=1)
    lora_trains(out, teacher_dir, student_dir)
    resume_and_export(out, teacher_dir, student_dir, other_student_dir)
    feature_losses(out, teacher_dir, student_dir)


if __name__ == "__main__":
    main()
