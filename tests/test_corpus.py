"""The stdlib corpus: library files only, split by file with a hash that no run or Python changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distill_kit.data.corpus import is_heldout, source_files, stable_fraction, stdlib_root, write_corpus


def fake_stdlib(root: Path, modules: int = 40) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(modules):
        (root / f"mod{i}.py").write_text(f"def f{i}():\n    return {i}\n")
    for skipped in ("site-packages/pkg", "test", "idlelib/idle_test", "pkg/__pycache__"):
        (root / skipped).mkdir(parents=True, exist_ok=True)
        (root / skipped / "skip.py").write_text("x = 1\n")
    (root / "pkg" / "inner.py").write_text("y = 2\n")
    (root / "empty.py").write_text("\n")
    (root / "notes.txt").write_text("not python\n")
    return root


def rows(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_library_files_only_in_a_fixed_order(tmp_path):
    files = source_files(fake_stdlib(tmp_path))
    assert "pkg/inner.py" in files and "empty.py" in files
    assert not any("skip.py" in path for path in files)
    assert files == source_files(tmp_path)  # the order does not depend on the file system's
    assert files != sorted(files)  # hash order mixes modules, so a prefix is not just the "a"s


def test_split_is_by_file_and_stable(tmp_path):
    splits = write_corpus(tmp_path / "out", root=fake_stdlib(tmp_path / "lib"), heldout_fraction=0.3)
    train, heldout = rows(splits.train), rows(splits.heldout)
    assert {r["path"] for r in train}.isdisjoint(r["path"] for r in heldout)
    assert len(train) + len(heldout) == 41  # 40 modules + pkg/inner.py; the blank file is skipped
    assert all(is_heldout(r["path"], 0.3) for r in heldout)
    assert 0 < len(heldout) < len(train)
    # The hash is sha256, not Python's per-process hash: this value holds on every run and version.
    assert stable_fraction("json/decoder.py") == pytest.approx(0.2312, abs=1e-4)


def test_reuses_a_matching_corpus_and_rewrites_a_stale_one(tmp_path):
    lib = fake_stdlib(tmp_path / "lib")
    splits = write_corpus(tmp_path / "out", root=lib)
    stamp = splits.train.stat().st_mtime_ns
    assert write_corpus(tmp_path / "out", root=lib).train.stat().st_mtime_ns == stamp
    write_corpus(tmp_path / "out", root=lib, heldout_fraction=0.5)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["heldout_fraction"] == 0.5


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        write_corpus(tmp_path / "out", root=tmp_path / "missing")
    with pytest.raises(ValueError, match="heldout_fraction"):
        write_corpus(tmp_path / "out", root=tmp_path, heldout_fraction=1.0)


def test_this_python_has_a_stdlib_corpus():
    files = source_files(stdlib_root())
    assert "json/decoder.py" in files and len(files) > 300
