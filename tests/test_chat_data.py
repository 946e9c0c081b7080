"""Chat data (``distill_kit/data/chat.py``): exact assistant masks, records, length-grouped batches, errors, CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launch import ROOT, run_ranks
from test_cli import _main_error
from tiny_models import save_cli_teacher
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill_kit.data import chat
from distill_kit.data.blocks import DataConfig
from distill_kit.data.tokenizer import train_tokenizer
from distill_kit.errors import ConfigError
from distill_kit.run import run_config

SCRIPT = ROOT / "scripts/distill.py"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
DEFAULT_TOKENIZER = Path(run_config.DEFAULT_TEACHER)
N = -100
BLOCK = 64  # the CLI runs' data.block_size, the tiny teacher's n_positions

SYSTEM = {"role": "system", "content": "Be brief."}
Q1, A1 = {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}
Q2, A2 = {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6, of course."}


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE (like the embedded default's) with both shipped templates' special tokens added."""
    texts = [path.read_text() for path in sorted((ROOT / "distill_kit").glob("**/*.py"))]
    tok = train_tokenizer(texts, vocab_size=300)
    tok.add_tokens(CHAT_TOKENS, special_tokens=True)
    return tok


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _expected_chatml(tok, messages, counted_turns) -> tuple[list[int], list[int]]:
    """ChatML by hand: <|im_start|>role\\ncontent<|im_end|>\\n per message; a counted assistant message counts its
    content, <|im_end|> and the newline. The role header's newline and the content are separate pre-tokens."""
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids, labels = [], []
    for i, message in enumerate(messages):
        head = [start] + _enc(tok, message["role"] + "\n")
        body = _enc(tok, message["content"]) + [end] + _enc(tok, "\n")
        ids += head + body
        labels += [N] * len(head) + (body if i in counted_turns else [N] * len(body))
    return ids, labels


def _expected_llama3(tok, messages, counted_turns) -> tuple[list[int], list[int]]:
    """Llama 3 by hand: <|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>; a counted assistant message
    counts its content and <|eot_id|>. GPT-2's pre-tokenizer splits "\\n\\nX" into "\\n", "\\n", "X"."""
    head_start, head_end, eot = tok.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    ids, labels = [], []
    for i, message in enumerate(messages):
        head = [head_start] + _enc(tok, message["role"]) + [head_end] + _enc(tok, "\n") + _enc(tok, "\n")
        body = _enc(tok, message["content"]) + [eot]
        ids += head + body
        labels += [N] * len(head) + (body if i in counted_turns else [N] * len(body))
    return ids, labels


EXPECTED = {"chatml": _expected_chatml, "llama3": _expected_llama3}
CONVERSATIONS = {
    "single": ([Q1, A1], {1}),
    "multi": ([SYSTEM, Q1, A1, Q2, A2], {2, 4}),
}


@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("turns", ["single", "multi"])
@pytest.mark.parametrize("assistant_turns", ["all", "last"])
def test_masks_are_exact_for_both_shipped_templates(tokenizer, template, turns, assistant_turns):
    messages, counted = CONVERSATIONS[turns]
    if assistant_turns == "last":
        counted = {max(counted)}
    encoder = chat.ChatEncoder(tokenizer, chat.resolve_template(tokenizer, template), assistant_turns)
    assert encoder.has_markers
    ids, labels = encoder.encode(messages, "test")
    assert (ids, labels) == EXPECTED[template](tokenizer, messages, counted)


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_generation_markers_agree_with_rendering_prefixes(tokenizer, template, caplog):
    """The same template without its {% generation %} markers takes the prefix path; both count the same tokens."""
    text = chat.resolve_template(tokenizer, template)
    plain = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", text)
    marked, unmarked = chat.ChatEncoder(tokenizer, text), chat.ChatEncoder(tokenizer, plain)
    assert not unmarked.has_markers
    for messages in ([Q1, A1], [SYSTEM, Q1, A1, Q2, A2], [Q1, A1, Q2, A2]):
        assert unmarked.encode(messages, "test") == marked.encode(messages, "test", check=True)
    assert "markers count tokens" not in caplog.text


def test_markers_that_disagree_with_the_conversation_are_used_and_reported(tokenizer, caplog):
    """Markers around the content only (not <|im_end|>): they win, and the first records' check says so."""
    text = chat.resolve_template(tokenizer, "chatml").replace(
        "{%- generation %}{{- message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}",
        "{%- generation %}{{- message['content'] }}{%- endgeneration %}{{- '<|im_end|>\\n' }}")
    encoder = chat.ChatEncoder(tokenizer, text)
    ids, labels = encoder.encode([Q1, A1], "data.jsonl: record 0", check=True)
    assert [label for label in labels if label != N] == _enc(tokenizer, A1["content"])
    assert "data.jsonl: record 0: the template's {% generation %} markers count tokens" in caplog.text
    caplog.clear()
    encoder.encode([Q1, A1], "data.jsonl: record 9")  # past the checked records: no second rendering
    assert caplog.text == ""


def test_the_embedded_default_tokenizer_counts_exactly_the_assistant_text():
    """No chat special tokens there: the markup is spelled in several tokens, the mask is still exact."""
    tok = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)
    encoder = chat.ChatEncoder(tok, chat.resolve_template(tok, "chatml"))
    ids, labels = encoder.encode([SYSTEM, Q1, A1, Q2, A2], "test")
    spans = [(i, i + 1) for i, label in enumerate(labels) if label != N]
    assert tok.decode([ids[i] for i, _ in spans]) == "4.<|im_end|>\n6, of course.<|im_end|>\n"
    assert tok.decode(ids) == tok.apply_chat_template([SYSTEM, Q1, A1, Q2, A2], chat_template=encoder.template,
                                                      tokenize=False)


def test_prompt_completion_records_and_prompts(tokenizer):
    encoder = chat.ChatEncoder(tokenizer, chat.resolve_template(tokenizer, "chatml"))
    as_messages = chat.record_messages({"messages": [Q1, A1]}, "r")
    for record in ({"prompt": Q1["content"], "completion": A1["content"]},
                   {"prompt": [Q1], "completion": [A1]}, {"prompt": [Q1], "completion": A1["content"]}):
        assert chat.record_messages(record, "r") == as_messages
    # A prompt (no completion, or a conversation ending with the user): generation prompt at the end, nothing counts.
    for record in ({"prompt": Q1["content"]}, {"prompt": Q1["content"], "completion": None},
                   {"messages": [Q1, A1, Q2]}):
        messages = chat.record_messages(record, "r")
        ids, labels = encoder.encode(messages, "r")
        assert labels == [N] * len(ids)
        assert ids[-len(_enc(tokenizer, "assistant\n")) - 1:] == (
            tokenizer.convert_tokens_to_ids(["<|im_start|>"]) + _enc(tokenizer, "assistant\n"))
    full_ids, full_labels = encoder.encode(as_messages, "r")
    prompt_ids, _ = encoder.encode([Q1], "r")
    batch = chat.pad_rows([full_ids, prompt_ids], [full_labels, [N] * len(prompt_ids)], pad_id=0)
    # The completion's prompt is exactly the prompt record's tokens; a prompt-only row is its whole length.
    assert chat.prompt_lengths(batch).tolist() == [len(prompt_ids), len(prompt_ids)]
    assert full_ids[: len(prompt_ids)] == prompt_ids
    two_turns, two_labels = encoder.encode([Q1, A1, Q2, A2], "r")
    batch = chat.pad_rows([full_ids, two_turns, prompt_ids], [full_labels, two_labels, [N] * len(prompt_ids)], 0)
    prompts = chat.left_padded_prompts(batch, pad_id=0)
    assert prompts["input_ids"].shape == (3, len(prompt_ids))  # the first assistant turn starts every row's answer
    assert prompts["input_ids"].tolist() == [prompt_ids] * 3 and prompts["attention_mask"].min() == 1
    last = chat.ChatEncoder(tokenizer, encoder.template, "last").encode([Q1, A1, Q2, A2], "r")
    batch = chat.pad_rows([prompt_ids, last[0]], [[N] * len(prompt_ids), last[1]], pad_id=0)
    assert chat.prompt_lengths(batch).tolist() == [len(prompt_ids), len(encoder.encode([Q1, A1, Q2], "r")[0])]
    prompts = chat.left_padded_prompts(batch, pad_id=0)
    short = len(prompt_ids)
    width = prompts["input_ids"].shape[1]
    assert prompts["input_ids"][0].tolist() == [0] * (width - short) + prompt_ids
    assert prompts["attention_mask"][0].tolist() == [0] * (width - short) + [1] * short
    assert prompts["input_ids"][1].tolist() == encoder.encode([Q1, A1, Q2], "r")[0]


def _dataset(lengths: list[int]):
    rows = [{"input_ids": [7] * n, "labels": [N] * (n - 1) + [7], "length": n, "counted": 1, "record": f"r{i}"}
            for i, n in enumerate(lengths)]
    import datasets
    return datasets.Dataset.from_list(rows, features=chat.FEATURES)


def test_length_grouping_equal_batches_on_every_rank_and_resume():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 200, (1003,), generator=generator).tolist()
    dataset = _dataset(lengths)
    loaders = [chat.ChatLoader(dataset, 4, pad_id=0, rank=r, world_size=2, seed=3) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == 1003 // 8
    seen, padded, real = [], 0, 0
    epoch = [list(loader) for loader in loaders]
    for rank_batches in epoch:
        for batch in rank_batches:
            rows = batch["attention_mask"].sum(1)
            seen += [int(n) for n in rows]
            real += int(rows.sum())
            padded += batch["input_ids"].numel()
            assert batch["input_ids"].shape[1] == int(rows.max())  # padded to this micro-batch's longest row
            assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()
            assert (batch["labels"][batch["attention_mask"] == 0] == N).all()
    assert len(seen) == 1003 // 8 * 8
    # Grouping by length: far less padding than batches of random rows (about 2/3 of the tokens would be real).
    assert real / padded > 0.95
    # Shuffled across groups: the batches' lengths are not in sorted order; deterministic by seed and epoch.
    first_lengths = [int(b["attention_mask"].sum(1).max()) for b in epoch[0]]
    assert first_lengths != sorted(first_lengths, reverse=True)
    again = chat.ChatLoader(dataset, 4, pad_id=0, rank=0, world_size=2, seed=3)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(again, epoch[0], strict=True))
    assert loaders[0].epoch_order(1) != loaders[0].epoch_order(0)
    assert sorted(loaders[0].epoch_order(1)) == list(range(1003))
    # Resume: a loader given another's position continues with exactly the batches the first one goes on with.
    stream = iter(loaders[0])
    for _ in range(5):
        next(stream)
    resumed = chat.ChatLoader(dataset, 4, pad_id=0, rank=0, world_size=2, seed=3)
    resumed.load_state_dict(loaders[0].state_dict())
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed, stream, strict=True))


def test_evaluation_loader_fills_the_last_global_batch_with_rows_that_count_nothing():
    dataset = _dataset([5, 9, 3, 7, 4])
    loaders = [chat.ChatLoader(dataset, 2, pad_id=0, rank=r, world_size=2, shuffle=False, drop_last=False)
               for r in range(2)]
    batches = [list(loader) for loader in loaders]
    assert len(batches[0]) == len(batches[1]) == 2
    counted = sum(int((b["labels"] != N).sum()) for rank in batches for b in rank)
    assert counted == 5  # every conversation once, fillers count nothing
    assert sorted(int(n) for rank in batches for b in rank for n in b["attention_mask"].sum(1)) == [1, 1, 1, 3, 4, 5,
                                                                                                    7, 9]


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_truncation_and_dropping_are_counted(tokenizer, tmp_path, caplog):
    long_answer = {"messages": [Q1, {"role": "assistant", "content": "x " * 200}]}
    long_prompt = {"prompt": "y " * 200, "completion": "z"}
    records = [{"messages": [Q1, A1]}, long_answer, long_prompt, {"prompt": "y " * 200}, {"prompt": "hi"}]
    train = _write_jsonl(tmp_path / "train.jsonl", records)
    config = DataConfig(train=str(train), heldout=str(train), block_size=64, chat_template="chatml")
    splits = chat.build_splits(config, tokenizer)
    stats = splits.stats["train"]
    assert (stats.records, stats.truncated, stats.dropped, stats.prompts) == (5, 1, 2, 1)
    assert splits.train["length"] == [len(_expected_chatml(tokenizer, [Q1, A1], {1})[0]), 64,
                                       len(chat.ChatEncoder(tokenizer, chat.resolve_template(tokenizer, "chatml"))
                                           .encode([{"role": "user", "content": "hi"}], "")[0])]
    kept = splits.train[1]
    assert kept["input_ids"] == chat.ChatEncoder(tokenizer, chat.resolve_template(tokenizer, "chatml")).encode(
        chat.record_messages(long_answer, ""), "")[0][:64]
    assert stats.first_prompt == f"{train}: record 4 (line 5)"
    stats.log("train", 64)
    assert ("WARNING", "chat data train: 5 records, 1 prompts without an answer, 1 truncated to block_size 64, 2 "
            "dropped") == (caplog.records[-1].levelname, caplog.records[-1].getMessage()[:96])


def test_format_is_detected_from_the_records(tmp_path):
    text = _write_jsonl(tmp_path / "text.jsonl", [{"text": "def f(): pass"}])
    _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [Q1, A1]}])
    _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hi", "completion": "hello"}])
    (tmp_path / "plain.txt").write_text("hello")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"messages": [Q1, A1]}]), tmp_path / "chat.parquet")
    detect = {path: chat.detect_format(DataConfig(train=str(tmp_path / path)))
              for path in ("text.jsonl", "chat.jsonl", "prompts.jsonl", "plain.txt", "chat.parquet")}
    assert detect == {"text.jsonl": "text", "chat.jsonl": "chat", "prompts.jsonl": "chat", "plain.txt": "text",
                      "chat.parquet": "chat"}
    assert chat.detect_format(DataConfig(train=str(text), format="chat")) == "chat"
    assert [m for _, r in chat.read_records(str(tmp_path / "chat.parquet")) for m in r["messages"]] == [Q1, A1]


@pytest.mark.parametrize(("records", "message"), [
    ([{"messages": [Q1, {"role": "robot", "content": "beep"}]}],
     "record 0 (line 1): messages[1] has unknown role 'robot'; roles are system, developer, user, assistant, tool"),
    ([{"messages": [Q1, A1]}, {"text": "plain"}], "record 1 (line 2): a chat record needs 'messages' or 'prompt'"),
    ([{"messages": "hello"}], "record 0 (line 1): 'messages' must be a non-empty list"),
    ([{"messages": [Q1, {"role": "assistant"}]}], "messages[1] must be a mapping with 'role' and 'content'"),
    ([{"messages": [Q1, {"role": "assistant", "content": ["x"]}]}], "messages[1] content must be a string"),
    ([{"messages": [A1, Q1, A1]}], "the conversation starts with an assistant message"),
    ([{"prompt": "hi", "completion": [Q1]}], "every message of 'completion' must have role 'assistant'"),
    (["just a string"], "record 0 (line 1): a chat record must be a JSON object"),
])
def test_malformed_records_name_the_file_and_record(tokenizer, tmp_path, records, message):
    train = _write_jsonl(tmp_path / "train.jsonl", records)
    config = DataConfig(train=str(train), heldout=str(train), chat_template="chatml")
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        chat.build_splits(config, tokenizer)
    assert str(train) in str(error.value)


def test_chat_data_errors(tokenizer, tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", [{"messages": [Q1, A1]}] * 3)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"messages": [Q1, A1]}) + "\n{not json\n")
    default = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)
    with pytest.raises(ConfigError, match="record 1 \\(line 2\\) is not valid JSON"):
        chat.build_splits(DataConfig(train=str(broken), heldout=str(good), chat_template="chatml"), tokenizer)
    with pytest.raises(ConfigError, match="has no chat template: set data.chat_template to one of the shipped "
                                          "templates \\(chatml, llama3\\)"):
        chat.build_splits(DataConfig(train=str(good), heldout=str(good)), default)
    with pytest.raises(ConfigError, match="'vicuna' is neither a named template \\(shipped: chatml, llama3\\) nor"):
        chat.build_splits(DataConfig(train=str(good), heldout=str(good), chat_template="vicuna"), default)
    # A tokenizer with several named templates: its default renders unless another is named.
    named = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)
    named.chat_template = {"default": "{% for m in messages %}{{ m.content }}{% endfor %}", "terse": "{{ 'x' }}"}
    assert chat.resolve_template(named, None) == named.chat_template["default"]
    assert chat.resolve_template(named, "terse") == "{{ 'x' }}"
    assert chat.resolve_template(named, "chatml") == chat.resolve_template(default, "chatml")
    with pytest.raises(ConfigError, match=re.escape("'vicuna' is neither a named template (the tokenizer's (default, "
                                                    "terse), shipped: chatml, llama3) nor an existing .jinja file")):
        chat.resolve_template(named, "vicuna")
    text = tmp_path / "plain.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError, match="a plain-text file cannot hold chat records"):
        chat.build_splits(DataConfig(train=str(text), heldout=str(good), format="chat", chat_template="chatml"),
                          tokenizer)
    # A template that renders earlier answers differently from the last one, without markers: no prefix path.
    hiding = tmp_path / "hiding.jinja"
    hiding.write_text("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' and not loop.last %}...{% else"
                      " %}{{ m.content }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    multi = _write_jsonl(tmp_path / "multi.jsonl", [{"messages": [Q1, A1, Q2, A2]}])
    with pytest.raises(ConfigError, match="record 0 \\(line 1\\): the chat template does not render message 1 as a "
                                          "continuation"):
        chat.build_splits(DataConfig(train=str(multi), heldout=str(multi), chat_template=str(hiding)), tokenizer)
    # A template that refuses a conversation (Llama-2-style role checks) names the record and its reason.
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system messages, "
                      "please') }}{% endif %}{{ m.content }}{% endfor %}")
    with_system = _write_jsonl(tmp_path / "system.jsonl", [{"messages": [Q1, A1]}, {"messages": [SYSTEM, Q1, A1]}])
    with pytest.raises(ConfigError, match="record 1 \\(line 2\\): the chat template cannot render this conversation: "
                                          "no system messages, please"):
        chat.build_splits(DataConfig(train=str(with_system), heldout=str(good), chat_template=str(strict)), tokenizer)
    # Only prompts, while the losses train on reference answers.
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hi"}, {"prompt": "ho"}])
    splits = chat.build_splits(DataConfig(train=str(prompts), heldout=str(good), chat_template="chatml"), tokenizer)
    with pytest.raises(ConfigError, match=re.escape(f"data.train holds only prompts (records without an assistant "
                                                    f"answer, e.g. {prompts}: record 0 (line 1)), but the students'")):
        chat.require_answers(splits, "the students' losses")
    with pytest.raises(ConfigError, match="data.streaming is for text"):
        chat.build_splits(DataConfig(train=str(good), heldout=str(good), streaming=True), tokenizer)


# ---- the CLI on a tiny chat dataset ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """A tiny GPT-2 teacher with the chat tokenizer, and arithmetic conversations (some multi-turn, some prompts)."""
    root = tmp_path_factory.mktemp("tiny_chat")
    generator = torch.Generator().manual_seed(0)

    def record(i: int) -> dict:
        a, b = torch.randint(0, 50, (2,), generator=generator).tolist()
        turns = [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"{a + b}."}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": f"And {a}*2?"}, {"role": "assistant", "content": f"{2 * a}."}]
        return {"messages": turns} if i % 5 else {"prompt": turns[0]["content"], "completion": turns[1]["content"]}

    _write_jsonl(root / "train.jsonl", [record(i) for i in range(40)] + [{"prompt": "What is 1+1?"}])
    _write_jsonl(root / "heldout.jsonl", [record(i) for i in range(40, 47)])
    teacher = save_cli_teacher(root / "teacher", tokenizer)
    return {"root": root, "teacher": teacher}


def _chat_args(tiny: dict[str, Path], out: Path) -> list[str]:
    return [
        f"teacher={tiny['teacher']}", f"output_dir={out}", f"cache_dir={out / 'cache'}",
        f"data.train={tiny['root'] / 'train.jsonl'}", f"data.heldout={tiny['root'] / 'heldout.jsonl'}",
        "data.chat_template=chatml", f"data.block_size={BLOCK}",
        "training.max_steps=4", "training.micro_batch_size=2", "training.lr=3e-3", "eval.every=2",
        "--students", "[{name: distilled, init: {n_layer: 1, n_embd: 32}, loss: forward_kl},"
        " {name: no_teacher, init: {n_layer: 1, n_embd: 32}, loss: cross_entropy}]",
    ]


def _assistant_perplexity(model_dir: Path, heldout: Path) -> float:
    """Perplexity of an exported student over the held-out assistant tokens, one conversation at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    encoder = chat.ChatEncoder(tok, chat.resolve_template(tok, "chatml"))
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for where, record in chat.read_records(str(heldout)):
            ids, labels = encoder.encode(chat.record_messages(record, where), where)
            ids, labels = ids[:BLOCK], labels[:BLOCK]  # the run's truncation: the first block_size tokens
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            keep = target != N
            nll += F.cross_entropy(logits[keep], target[keep], reduction="sum").item()
            tokens += int(keep.sum())
    return math.exp(nll / tokens)


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [0, 2])
def test_cli_trains_on_chat_data(tiny_chat, tmp_path, ranks):
    """1 rank (python) and 2 ranks (the deepspeed launcher): the run trains, and its held-out perplexity is over
    assistant tokens only, padded batches included (an exported student reproduces it conversation by conversation).
    The 2 ranks also run research code's Distiller subclass, by import path: the CLI runs it with everything else
    unchanged, and every rank exits 0 with its process group destroyed."""
    out = tmp_path / "run"
    if ranks:
        done = run_ranks(ROOT / "tests/workers/cli_run.py", [
            *_chat_args(tiny_chat, out), "distiller=tests.user_distillers:MarkedDistiller"], nprocs=2,
            launcher="deepspeed")
        assert done.stdout.count("process group destroyed before exit") == 2
        assert all(r["distilled/subclass"] == 1.0 for r in _jsonl(out / "train.jsonl"))  # the subclass's hook ran
    else:
        done = run_ranks(SCRIPT, _chat_args(tiny_chat, out), nprocs=0)
    assert "chat data train: 41 records, 1 prompts without an answer" in done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    students = report["summary"]["students"]
    assert [e["step"] for e in report["evaluations"]] == [2, 4]
    for name in ("distilled", "no_teacher"):
        exported = _assistant_perplexity(out / "students" / name, tiny_chat["root"] / "heldout.jsonl")
        assert exported == pytest.approx(students[name]["perplexity"], rel=1e-4)
    if ranks:
        return
    # Stopped after 2 steps and resumed: the same batches (the loader's position is checkpointed), the same run.
    split = tmp_path / "resumed"
    run_ranks(SCRIPT, [*_chat_args(tiny_chat, split), "training.max_steps=2"], nprocs=0)
    run_ranks(SCRIPT, [*_chat_args(tiny_chat, split), "--resume"], nprocs=0)
    losses = [[{k: v for k, v in r.items() if k.endswith("loss")} for r in _jsonl(run / "train.jsonl")]
              for run in (out, split)]
    assert len(losses[0]) == 4 and losses[1] == losses[0]
    for name in ("distilled", "no_teacher"):
        whole = AutoModelForCausalLM.from_pretrained(out / "students" / name).state_dict()
        resumed = AutoModelForCausalLM.from_pretrained(split / "students" / name).state_dict()
        assert all(torch.equal(whole[key], resumed[key]) for key in whole)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cli_refuses_a_dataset_of_prompts_before_training(tiny_chat, tmp_path):
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"What is {i}+1?"} for i in range(8)])
    args = [a for a in _chat_args(tiny_chat, tmp_path / "run") if not a.startswith("data.train=")]
    got = _main_error(*args, f"data.train={prompts}")
    assert f"config error: data.train holds only prompts (records without an assistant answer, e.g. {prompts}: " \
           "record 0 (line 1))" in got
    assert not (tmp_path / "run" / "init").exists()  # refused before any student was written


def test_chat_loader_needs_one_global_batch():
    with pytest.raises(ConfigError, match=re.escape("the data has 5 conversations but one global batch needs "
                                                    "world_size (2) x micro_batch_size (4) = 8")):
        chat.ChatLoader(_dataset([3] * 5), 4, pad_id=0, rank=0, world_size=2)


def test_held_out_fraction_splits_the_records(tokenizer, tmp_path):
    records = [{"messages": [Q1, {"role": "assistant", "content": str(i)}]} for i in range(18)] + [{"prompt": "hi"}] * 2
    train = _write_jsonl(tmp_path / "train.jsonl", records)
    config = DataConfig(train=str(train), heldout_fraction=0.25, chat_template="chatml", max_train_blocks=12)
    splits = chat.build_splits(config, tokenizer)
    assert (len(splits.train), len(splits.heldout)) == (12, 5)
    assert set(splits.train["record"]).isdisjoint(splits.heldout["record"])
    for name, split in (("train", splits.train), ("heldout", splits.heldout)):
        stats = splits.stats[name]
        assert stats.prompts == sum(c == 0 for c in split["counted"])
        assert stats.counted_tokens == sum(sum(label != N for label in row) for row in split["labels"])


def test_chat_settings_are_typed_and_documented_in_help():
    text = run_config.help_text()
    for key in ("data.format (default \"auto\")", "data.chat_template (default null)",
                "data.assistant_turns (default \"all\")"):
        assert key in text
    config = run_config.load(None, ["data.format=chat", "data.assistant_turns=last", "data.chat_template=llama3"])
    assert (config.data.format, config.data.assistant_turns, config.data.chat_template) == ("chat", "last", "llama3")
    with pytest.raises(ConfigError, match="data.assistant_turns: 'first' is not one of \\['all', 'last'\\]"):
        run_config.load(None, ["data.assistant_turns=first"])
    with pytest.raises(ConfigError, match="data.format: 'sharegpt' is not one of \\['auto', 'text', 'chat'\\]"):
        run_config.load(None, ["data.format=sharegpt"])
