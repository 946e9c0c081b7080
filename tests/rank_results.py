"""What the rank workers in tests/workers/ share: gathering weights and writing each rank's results."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from tiny_models import gpt2_config, save_pair
from transformers import GPT2LMHeadModel

from distill_kit import Distiller
from distill_kit.engines import distributed


def gathered(source: torch.nn.Module | Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Full float32 copies of a module's (or the given) parameters, whatever their ZeRO partitioning."""
    params = list(source.parameters() if isinstance(source, torch.nn.Module) else source)
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone().float() for p in params]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def write(out: Path, name: str, result: dict) -> None:
    """``<out>/<name>.rank<r>.json``, read back by the pytest side."""
    (out / f"{name}.rank{distributed.rank()}.json").write_text(json.dumps(result))


def read(out: Path, ranks: int) -> dict[str, list[dict]]:
    """Every scenario's results that :func:`write` left in ``out``, by name, one per rank in rank order."""
    return {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(ranks)]
            for name in {p.name.split(".rank")[0] for p in out.glob("*.rank*.json")}}


def saved_pair(out: Path) -> tuple[Path, Path]:
    """The tiny teacher and student of ``tiny_models.save_pair``, written once by rank 0 for every rank."""
    if distributed.is_main():
        save_pair(out / "models")
    distributed.barrier()
    return out / "models/teacher", out / "models/student"


def saved_model(out: Path, name: str, seed: int, width: int, layers: int) -> Path:
    """One more tiny GPT-2 (``tiny_models.gpt2_config``) from ``seed``, written by rank 0 to ``<out>/models/<name>``
    for every rank."""
    path = out / "models" / name
    if distributed.is_main():
        torch.manual_seed(seed)
        GPT2LMHeadModel(gpt2_config(width=width, layers=layers)).save_pretrained(path)
    distributed.barrier()
    return path


def plain_kl(student: torch.nn.Module, teacher: torch.nn.Module, batch: dict, reverse: bool = False) -> tuple:
    """The plain-PyTorch references' loss of one micro-batch: KL(teacher || student) (``reverse``: KL(student ||
    teacher)) summed over its counted next tokens, and how many there are; written out, not through losses/."""
    s_logp = F.log_softmax(student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                           .logits[:, :-1], -1)
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                               .logits[:, :-1], -1)
    p, log_p, log_q = (s_logp.exp(), s_logp, t_logp) if reverse else (t_logp.exp(), t_logp, s_logp)
    valid = batch["labels"][:, 1:] != -100
    return ((p * (log_p - log_q)).sum(-1) * valid).sum(), int(valid.sum())


def plain_adamw(params, training) -> torch.optim.Optimizer:
    """The plain-PyTorch references' optimizer: torch's AdamW with the run's settings (``training``: TrainingConfig)."""
    return torch.optim.AdamW(params, lr=training.lr, betas=training.betas, eps=training.eps,
                             weight_decay=training.weight_decay)


def plain_step(opt: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float) -> float:
    """One optimizer step of a plain-PyTorch reference: backward, clip the global norm, step; the loss's value."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], max_grad_norm)
    opt.step()
    return loss.item()


class Recording(Distiller):
    """A Distiller that keeps every micro-batch it trained on (with each one's longest row before padding, as
    ``unpadded``) and counts the teacher's forwards: what the scenario workers check the engine's run against."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.made: list[dict] = []
        self.teacher_forwards = 0

    def teacher_forward(self, batch):
        self.teacher_forwards += 1
        return super().teacher_forward(batch)

    def make_batches(self, batches):
        made = super().make_batches(batches)
        self.made += [{k: v.detach().cpu().clone() for k, v in batch.items() if torch.is_tensor(v)}
                      | {"unpadded": int(batch["attention_mask"].sum(1).max()) if "attention_mask" in batch else None}
                      for batch in made]
        return made
