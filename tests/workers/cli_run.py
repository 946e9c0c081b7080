"""A tiny end-to-end run of the CLI (``distill_kit.run.cli.main``) on whatever ranks launched it."""

import sys

import torch.distributed as dist

from distill_kit.run.cli import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    if not dist.is_initialized():  # the test asserts that a finished run leaves no group for the exit to trip on
        print("process group destroyed before exit", flush=True)
    sys.exit(code)
