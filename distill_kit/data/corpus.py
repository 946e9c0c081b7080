"""The embedded default's corpus: the Python standard library's own ``.py`` sources.

Why this corpus: every machine that runs the project has it, offline, and it is real, varied text
(~12 MB of code, comments and docstrings) that a small model can learn a lot about in minutes.

Why the split is by *file* and by a hash of the file's path relative to the stdlib root: held-out
perplexity then measures generalisation to unseen modules rather than to unseen lines of a module
already seen, and the same paths are held out on every Python version. The shipped teacher was
trained on one Python's stdlib; on another Python the files differ a little, but a held-out path
stays held out, so the teacher never saw the modules the report evaluates on.

The two splits are written as JSON Lines (``{"path": ..., "text": ...}``, one file a row) so that
``datasets.load_dataset("json", ...)`` reads them like any user corpus.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Folders that are not the stdlib's own library code: installed packages (pyenv and some distros
# keep site-packages inside the stdlib folder) and the regression tests, which are huge, repetitive
# and partly in other encodings.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
DEFAULT_HELDOUT_FRACTION = 0.05
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class CorpusSplits:
    """Paths of the two JSON Lines files, ready for ``load_dataset("json", data_files=...)``."""

    train: Path
    heldout: Path

    def data_files(self) -> dict[str, str]:
        """The ``data_files`` mapping that ``datasets.load_dataset`` takes."""
        return {"train": str(self.train), "heldout": str(self.heldout)}


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by ``key`` alone: no process seed, no Python version (unlike ``hash``)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(relative_path: str, heldout_fraction: float) -> bool:
    """Whether the file at this stdlib-relative POSIX path belongs to the held-out split."""
    return stable_fraction(relative_path) < heldout_fraction


def source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the library's ``.py`` files, in hash order.

    Hash order rather than alphabetical order so that any prefix of the training file (a
    data-scarce slice) is a mix of modules, not just those whose names start with ``_`` or ``a``.
    """
    paths = [
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    return sorted(paths, key=lambda rel: (stable_fraction("order:" + rel), rel))


def write_corpus(
    out_dir: Path,
    root: Path | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
) -> CorpusSplits:
    """Write ``train.jsonl`` and ``heldout.jsonl`` under ``out_dir`` and return their paths.

    Cached: if ``out_dir`` already holds a corpus written from the same root and fraction, it is
    reused, so the default run pays the ~1 s of reading the stdlib only once.
    """
    root = stdlib_root() if root is None else root
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = CorpusSplits(train=out_dir / "train.jsonl", heldout=out_dir / "heldout.jsonl")
    manifest = {"root": str(root), "python": sys.version.split()[0], "heldout_fraction": heldout_fraction}
    manifest_path = out_dir / MANIFEST_NAME
    if manifest_path.exists() and splits.train.exists() and splits.heldout.exists():
        if json.loads(manifest_path.read_text()) == manifest:
            return splits

    with splits.train.open("w", encoding="utf-8") as train, splits.heldout.open("w", encoding="utf-8") as heldout:
        for rel in source_files(root):
            try:
                text = (root / rel).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # a file in another encoding or unreadable: not worth failing the run for
            if not text.strip():
                continue
            target = heldout if is_heldout(rel, heldout_fraction) else train
            target.write(json.dumps({"path": rel, "text": text}) + "\n")
    if splits.heldout.stat().st_size == 0 or splits.train.stat().st_size == 0:
        raise RuntimeError(f"no usable .py files under {root}: one split of the corpus is empty")
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return splits
