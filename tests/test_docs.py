"""The docs cannot drift from the code: whatever README.md, docs/*.md, benchmarks/RESULTS.md (and its pages) and
``--help`` name must exist.

* every test id (``tests/x.py::name``, or ``…::name`` after one in the same line): the file and the test;
* every error message quoted as the code's (the Error column of docs/errors.md; any ``SomethingError: …`` or
  ``config error: …`` span elsewhere): each of its literal stretches of three or more words is in the code's
  strings (values, numbers and ``…`` are the parts the code fills in);
* every config key (``training.lr``, ``data.teacher_field``, ``students[i].loss``, ``--eval.every``): a field of
  the run config's dataclasses;
* every repository path (``distill_kit/...``, ``benchmarks/results/...``, a relative link): a file or folder;
* every section link (``docs/run.md#trackers``, ``#hooks``, a README section quoted by name): a heading there.

Python docstrings and comments are read for the same paths, links and README sections, since ``--help`` prints
the first and readers follow the others. Read with regular expressions and ``ast``; nothing is run.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import types
import typing
from functools import cache
from pathlib import Path

import pytest

from distill_kit.run import run_config

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("distill_kit", "losses", "scripts", "benchmarks")
TOP = ("distill_kit", "losses", "scripts", "configs", "benchmarks", "docs", "tests")


def documents() -> dict[str, tuple[Path, str]]:
    """name -> (the folder its relative links start from, its text)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md",
             *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
    found = {str(f.relative_to(ROOT)): (f.parent, f.read_text()) for f in files if f.is_file()}
    found["--help"] = (ROOT, run_config.help_text())
    return found


def code_spans(text: str) -> list[str]:
    """Inline code (```x```), outside fenced blocks."""
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", fenced(text)[0])


def fenced(text: str) -> tuple[str, str]:
    """(the text without its fenced blocks, the fenced blocks)."""
    blocks = re.findall(r"^```.*?^```", text, flags=re.S | re.M)
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), "\n".join(blocks)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]{1,2}(?=\S)|(?<=\S)[`*_]{1,2}", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", fenced(path.read_text())[0], flags=re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return frozenset(found)


@cache
def headings(path: Path) -> frozenset[str]:
    return frozenset(h.strip().lower() for h in re.findall(r"^#{1,6} (.+)$", fenced(path.read_text())[0], flags=re.M))


def python_files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py"))


# ---- test ids ---------------------------------------------------------------------------------------------


@cache
def defined_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))


def test_every_test_id_named_exists():
    problems = []
    for name, (_, text) in documents().items():
        for line in text.splitlines():
            last = None
            for match in re.finditer(r"(tests/[\w/]+\.py)::(\w+)|(?:…|\.\.\.)::(\w+)", line):
                file, test = (match.group(1), match.group(2)) if match.group(1) else (last, match.group(3))
                last = file
                if file is None:
                    problems.append(f"{name}: '{match.group(0)}' follows no test file in its line")
                elif not (ROOT / file).is_file():
                    problems.append(f"{name}: {file}::{test}: there is no {file}")
                elif test not in defined_names(ROOT / file):
                    problems.append(f"{name}: {file}::{test}: {file} has no {test}")
    assert not problems, "\n".join(problems)


# ---- error messages ---------------------------------------------------------------------------------------


def _pieces(node: ast.AST) -> list[str]:
    """A string's literal stretches: an f-string's constant parts; ``%s`` and ``{}`` placeholders split too."""
    if isinstance(node, ast.JoinedStr):
        parts = [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts = [node.value]
    else:
        return []
    return [p for part in parts for p in re.split(r"%[-+ #0-9.]*[sdrfgi]|\{[^{}]*\}", part)]


@cache
def code_strings() -> tuple[tuple[str | None, ...], ...]:
    """Every string of the code as words, a placeholder (what the code fills in) as ``None``."""
    found = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            pieces = _pieces(node)
            if pieces:
                words: list[str | None] = []
                for i, piece in enumerate(pieces):
                    words += ([None] if i else []) + re.findall(r"\w+", piece.lower())
                if len(words) >= 3:
                    found.append(tuple(words))
    return tuple(found)


LONGEST = 12


@cache
def _runs() -> frozenset[tuple[str, ...]]:
    """Every run of 2 to :data:`LONGEST` words that one string of the code says between its placeholders."""
    runs = set()
    for words in code_strings():
        for start in range(len(words)):
            for end in range(start + 2, min(start + LONGEST, len(words)) + 1):
                if words[end - 1] is None:
                    break
                runs.add(words[start:end])
    return frozenset(runs)


def said(segment: list[str], breaks: set[int]) -> bool:
    """Whether the code says ``segment``: runs of two words or more that the code's strings say (several strings may
    make one message), which meet only where the quote has a break (punctuation, a value) or at most two words
    between them (the values the code fills in); the runs cover two thirds of it, one at least 3 words (2 in a
    segment of 4 words or fewer). A sentence
    no code says is not stitched from common pairs of words."""
    runs = {i: [k for k in range(2, min(LONGEST, len(segment) - i) + 1) if tuple(segment[i:i + k]) in _runs()]
            for i in range(len(segment))}

    @cache
    def best(i: int, gap: int) -> tuple[int, int] | None:
        """(words covered, longest run) over segment[i:], ``gap`` words since the last run; None: no reading."""
        if i == len(segment):
            return 0, 0
        options = []
        if gap < 2:
            skipped = best(i + 1, gap + 1)
            if skipped is not None:
                options.append(skipped)
        if i == 0 or gap or i in breaks:
            for k in runs[i]:
                rest = best(i + k, 0)
                if rest is not None:
                    options.append((rest[0] + k, max(rest[1], k)))
        return max(options, default=None)

    found = best(0, 0)
    return found is not None and found[1] >= (3 if len(segment) > 4 else 2) and found[0] * 3 >= 2 * len(segment)


VALUES = r"\w+(?:, \w+){2,}|'[^'\s]*'|\"[^\"]*\"|\S*\d\S*|\S*[/=<>]\S*|\[[^\]]*\]|\S*\w[.\[\]]\w\S*"
"""What the code fills in, left out of a quoted message's words: lists, quoted values, numbers, paths, keys."""


def unsaid(message: str) -> list[str]:
    """The stretches of a quoted message (between ``…``) that the code does not say."""
    message = re.sub(r"^(?:[A-Z]\w*(?:Error|Exception)|config error): ", "", message.strip())
    problems = []
    for part in re.split(r"…|\.\.\.", message):
        words, breaks = [], set()
        for token in re.findall(r"\w+|[^\w\s]", re.sub(VALUES, " | ", part).lower()):
            if re.fullmatch(r"\w+", token):
                words.append(token)
            elif token not in "'-":
                breaks.add(len(words))
        if len(words) >= 3 and not said(words, breaks):
            problems.append(part.strip())
    return problems


def quoted_messages() -> list[tuple[str, str]]:
    """(document, message): the Error column of docs/errors.md, and spans that name an error type elsewhere."""
    found = []
    for name, (_, text) in documents().items():
        if name == "docs/errors.md":
            column = None
            for line in text.splitlines():
                if not line.startswith("|"):
                    column = None
                    continue
                cells = [c.strip() for c in re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line.strip().strip("|"))]
                if column is None:
                    column = cells.index("Error") if "Error" in cells else -1
                elif 0 <= column < len(cells):
                    found += [(name, span) for span in code_spans(cells[column])]
        else:
            found += [(name, s) for s in code_spans(text) if re.match(r"[A-Z]\w*(Error|Exception): |config error: ", s)]
    return found


def test_every_error_message_quoted_is_the_codes():
    problems = [f"{name}: `{message}`: no code says '{part}'" for name, message in quoted_messages()
                for part in unsaid(message)]
    assert not problems, "\n".join(problems)


# ---- config keys ------------------------------------------------------------------------------------------


def _inner(tp: typing.Any) -> typing.Any:
    """A field's type, less None and the tuple or list around a dataclass."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return _inner(args[0])
    if typing.get_origin(tp) in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return tp


def key_problem(key: str) -> str | None:
    """Why ``key`` (dotted, ``name[i]`` for an entry of a list) is not a config key; None when it is."""
    cls: typing.Any = run_config.RunConfig
    segments = key.split(".")
    for i, segment in enumerate(segments):
        field = re.sub(r"\[[^\]]*\]$", "", segment)
        if not dataclasses.is_dataclass(cls):
            return None if cls in (dict, typing.Any) or typing.get_origin(cls) is dict else (
                f"{'.'.join(segments[:i])} has no keys below it")
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if "*" in field:
            return None if any(re.fullmatch(field.replace("*", r"\w*"), n) for n in names) else f"no key {field}"
        if field not in names:
            return f"{cls.__name__} has no {field!r}"
        cls = _inner(hints[field])
    return None


SECTIONS = {f.name for f in dataclasses.fields(run_config.RunConfig)
            if dataclasses.is_dataclass(_inner(typing.get_type_hints(run_config.RunConfig)[f.name]))}
KEY = r"(?<![\w./\-\[])(?:--)?((?:{})(?:\[[^\]\s]*\])?(?:\.[A-Za-z_*]+(?:\[[^\]\s]*\])?)+)"


FILES = ("json", "jsonl", "yaml", "yml", "md", "py", "txt", "csv", "png", "safetensors")


def named_keys(text: str) -> list[str]:
    """Keys in code spans and ``--key`` in code blocks; a misspelled key quoted as bad input (a table row's first
    cell, or a span with "did you mean") and a file name (``eval.jsonl``) are not keys."""
    pattern = KEY.format("|".join(sorted(SECTIONS)))
    prose, blocks = fenced(text)
    prose = re.sub(r"^\|[^|]*\|", "|", prose, flags=re.M)
    keys = [k for span in code_spans(prose) if "did you mean" not in span for k in re.findall(pattern, span)
            if k.rsplit(".", 1)[-1] not in FILES]
    return keys + re.findall(r"--" + pattern.removeprefix(r"(?<![\w./\-\[])(?:--)?"), blocks)


def test_every_config_key_named_exists():
    assert key_problem("training.on_policy.fraction") is None and key_problem("students[0].peft.r") is None
    assert key_problem("training.no_such") is not None and key_problem("data.seed.x") is not None
    problems = []
    for name, (_, text) in documents().items():
        keys = named_keys(text) if name != "--help" else re.findall(r"^  (\S+)", text, flags=re.M)
        for key in keys:
            problem = key_problem(key.removesuffix(".*")) if key.split(".")[0].split("[")[0] in SECTIONS else None
            if problem is not None:
                problems.append(f"{name}: `{key}`: {problem}")
    assert not problems, "\n".join(problems)


# ---- paths and sections -----------------------------------------------------------------------------------


PATH = r"(?<![\w/.\-<])((?:{})/[\w./*\-]*[\w*])".format("|".join(TOP))


def path_problem(path: str, base: Path = ROOT) -> str | None:
    """None when ``path`` names a file or folder (a glob: one at least; ``losses/fused.HeadOutput``: a module's)."""
    if "*" in path:
        return None if list(base.glob(path)) else f"{path} matches no file"
    module = re.sub(r"\.\w+$", ".py", path)
    return None if (base / path).exists() or (base / module).is_file() else f"there is no {path}"


def link_problems(name: str, base: Path, text: str) -> list[str]:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", fenced(text)[0]):
        if re.match(r"\w+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (base / file) if file else None
        if path is not None and not path.exists():
            problems.append(f"{name}: link ({target}): there is no {path}")
            continue
        page = path if path is not None else (ROOT / name if name != "--help" else None)
        if anchor and page is not None and page.suffix == ".md" and anchor not in anchors(page):
            problems.append(f"{name}: link ({target}): {page.relative_to(ROOT)} has no section #{anchor}")
    return problems


def mention_problems(name: str, text: str) -> list[str]:
    """Paths, ``page.md#section`` and README sections named in running text (docs, --help, Python)."""
    problems = []
    for path in re.findall(PATH, text):
        problem = path_problem(path.rstrip("."))
        if problem is not None:
            problems.append(f"{name}: {problem}")
    for page, anchor in re.findall(r"(?<![\w/(])((?:[\w\-]+/)*[\w\-]+\.md)#([\w\-]+)", text):
        path = ROOT / page
        if path.is_file() and anchor not in anchors(path):
            problems.append(f"{name}: {page}#{anchor}: {page} has no such section")
    for section in re.findall(r"README(?:'s)? \(?[\"“]([^\"”]+)[\"”]", text):
        if section.strip().lower() not in headings(ROOT / "README.md"):
            problems.append(f"{name}: README has no section \"{section}\"")
    return problems


def test_every_path_and_section_named_exists():
    problems = []
    for name, (base, text) in documents().items():
        problems += link_problems(name, base, text) + mention_problems(name, text)
    assert not problems, "\n".join(problems)


def test_the_codes_docstrings_and_comments_name_what_exists():
    problems = []
    for path in python_files():
        source = path.read_text()
        text = "\n".join([*re.findall(r"#.*$", source, flags=re.M),
                          *(ast.get_docstring(n) or "" for n in ast.walk(ast.parse(source))
                            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)),
                          *re.findall(r'^\s*"""(.*?)"""', source, flags=re.S | re.M)])
        problems += mention_problems(str(path.relative_to(ROOT)), text)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, problem", [
    ("see `tests/test_docs.py::no_such_test`", "has no no_such_test"),
    ("`ConfigError: every teacher needs a name and a model`", "no code says"),
    ("set `training.no_such_key`", "has no 'no_such_key'"),
    ("in `distill_kit/no_such.py`", "there is no distill_kit/no_such.py"),
    ("[x](docs/run.md#no-such-section)", "has no section #no-such-section"),
    ('the README ("No such section")', "README has no section"),
])
def test_the_checks_catch_each_kind(text, problem, monkeypatch):
    """Each check fails on a made-up page that names what does not exist."""
    monkeypatch.setitem(globals(), "documents", lambda: {"docs/made_up.md": (ROOT, text)})
    found = []
    for check in (test_every_test_id_named_exists, test_every_error_message_quoted_is_the_codes,
                  test_every_config_key_named_exists, test_every_path_and_section_named_exists):
        try:
            check()
        except AssertionError as err:
            found.append(str(err))
    assert any(problem in f for f in found), found


def test_the_readmes_distiller_subclass_runs_on_a_padded_teacher_vocabulary():
    """The README's TopKDistiller, as printed, on a teacher whose vocabulary is padded past the student's (Qwen2-7B's
    152,064 rows against 0.5B's 151,936): the padded rows are cut, and the loss is finite; without the cut, the
    gather would index past the student's vocabulary."""
    import torch

    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    (code,) = [b for b in blocks if "class TopKDistiller" in b]
    namespace: dict[str, typing.Any] = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    student_vocab, teacher_vocab = 40, 48
    teacher = torch.randn(2, 5, teacher_vocab)
    teacher[..., student_vocab:] = 50.0  # padded rows the teacher would rank first
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    out = namespace["TopKDistiller"].compute_loss(None, types.SimpleNamespace(logits=torch.randn(2, 5, student_vocab)),
                                                 types.SimpleNamespace(logits=teacher), batch)
    assert torch.isfinite(out.total) and out.total >= 0
