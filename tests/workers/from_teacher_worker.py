"""Cut a student out of a ZeRO-3-sharded teacher on real ranks; launched by tests/test_from_teacher.py.

Writes ``<out>/student.pt`` (rank 0's student state dict) and ``<out>/partitioned.json`` (per rank: the
teacher's weights were still ZeRO-3 shards afterwards, i.e. nothing gathered the whole teacher and kept it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_from_teacher import WORKER_CHOICE, batches  # noqa: E402

from distill_kit.engines import distributed, models  # noqa: E402
from distill_kit.students.from_teacher import FromTeacherConfig, student_from_teacher  # noqa: E402

ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}


def main(out: Path) -> None:
    device = distributed.init()
    teacher = models.load(out / "teacher", ZERO3, "fp32")
    student = student_from_teacher(teacher, FromTeacherConfig(**WORKER_CHOICE), batches(), device=device)
    partitioned = all(hasattr(p, "ds_id") and p.data.numel() == 0 for p in teacher.parameters())
    everyone = distributed.all_gather_object(partitioned)
    if distributed.is_main():
        torch.save(student.state_dict(), out / "student.pt")
        (out / "partitioned.json").write_text(json.dumps({str(r): v for r, v in enumerate(everyone)}))
    distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
