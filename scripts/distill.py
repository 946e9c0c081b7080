"""Distil a teacher into students. With no arguments, the embedded default: the shipped stdlib teacher,
a fresh student, and the same student without a teacher, on this Python's standard library.

    python scripts/distill.py --help
    python scripts/distill.py --config run.yaml --training.max_steps 500
    torchrun --nproc_per_node 2 scripts/distill.py ...      (or: deepspeed --num_gpus 2 scripts/distill.py ...)
"""

import sys

from distill_kit.run.cli import main

if __name__ == "__main__":
    sys.exit(main())
