"""A tiny end-to-end run of the CLI (``distill_kit.run.cli.main``) on whatever ranks launched it."""

import sys

from distill_kit.run.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
