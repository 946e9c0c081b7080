"""The teacher's logits with faster kernels against the plain model's, under ZeRO-3, on one fixed batch.

One random-initialised teacher is built straight into ZeRO-3 shards (``pairs.py``) and run on a fixed batch
plain, then with each kernel choice patched into the same instance (``distill_kit/engines/kernels.py``); a
patched module that failed to gather its shards would compute on empty weights and fail or disagree wildly.
Reports, per choice against plain: the largest and mean absolute logit difference, the logits' spread, the
mean KL(plain || patched) per token and top-1 agreement; and the forward time of each. The yardstick for
"within bf16 tolerance" is the same comparison between the plain model and itself run one sequence at a time
(other kernels, other rounding, equally right). Writes
``OUT/kernels.json``. GPU (2x H200)::

    torchrun --nproc_per_node 2 benchmarks/check_kernels.py --out runs/kernels
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pairs
import torch
import torch.nn.functional as F
import transformers

from distill_kit.config import TrainingConfig
from distill_kit.engines import deepspeed_config, distributed, kernels
from distill_kit.engines.build import build_teacher

CONFIG = Path(__file__).resolve().parents[1] / "configs/zero3_teacher.json"


def forward(teacher, batch, repeats: int) -> tuple[torch.Tensor, float]:
    """The logits (float32, on CPU) and the median forward time in ms."""
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            logits = teacher(**batch).logits
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return logits.float().cpu(), sorted(times)[len(times) // 2]


def one_at_a_time(teacher, batch) -> torch.Tensor:
    """The same sequences run one per forward: other matmul tilings, so other bf16 rounding. The logits'
    difference from the batched run is the bf16 noise any equally valid kernel choice makes."""
    with torch.no_grad():
        return torch.cat([teacher(**{k: v[i:i + 1] for k, v in batch.items()}).logits.float().cpu()
                          for i in range(batch["input_ids"].shape[0])])


def compare(plain: torch.Tensor, patched: torch.Tensor) -> dict[str, float]:
    log_p, log_q = F.log_softmax(plain, -1), F.log_softmax(patched, -1)
    return {
        "max_abs_diff": (plain - patched).abs().max().item(),
        "mean_abs_diff": (plain - patched).abs().mean().item(),
        "logit_std": plain.std().item(),
        "mean_kl": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
        "top1_agreement": (plain.argmax(-1) == patched.argmax(-1)).float().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pair", choices=sorted(pairs.PAIRS), default="qwen2-7b-0.5b")
    parser.add_argument("--shape", default="4,1024", help="BATCH,LENGTH of the fixed batch per GPU")
    parser.add_argument("--choices", nargs="+", default=["compile", "liger"], help="applied in this order")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = distributed.init()
    transformers.logging.set_verbosity_error()
    config = pairs.PAIRS[args.pair].teacher
    batch_size, length = (int(x) for x in args.shape.split(","))
    training = TrainingConfig(micro_batch_size=batch_size, dtype="bf16", teacher_kernels="none")
    _, teacher_cfg = deepspeed_config.prepare_pair(CONFIG.parent / "zero2_student.json", CONFIG, training,
                                                  student_hidden_size=896, teacher_hidden_size=config.hidden_size,
                                                  world_size=distributed.world_size())
    model = pairs.build(config, teacher_cfg, "bf16", device, "sdpa")
    teacher = build_teacher(model, teacher_cfg, "bf16", device)
    generator = torch.Generator().manual_seed(1234 + distributed.rank())
    ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=generator).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    plain, plain_ms = forward(teacher, batch, args.repeats)
    again, _ = forward(teacher, batch, 1)
    result = {"pair": args.pair, "shape": [batch_size, length], "world_size": distributed.world_size(),
              "plain_ms": plain_ms, "plain_vs_itself": compare(plain, again),
              "plain_vs_plain_one_at_a_time": compare(plain, one_at_a_time(teacher, batch)), "choices": {}}
    for choice in args.choices:
        kernels.apply(model, choice)
        patched, ms = forward(teacher, batch, args.repeats)
        result["choices"][choice] = {"ms": ms, **compare(plain, patched)}
        if choice == "compile":  # undo it, so the next choice is measured alone
            for module in model.modules():
                module._compiled_call_impl = None
    if distributed.is_main():
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2), flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
