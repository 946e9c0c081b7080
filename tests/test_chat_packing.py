"""data.packing for chat: whole conversations per row, positions restarting, nothing crossing a boundary.

The exactness tests run real transformers models (GPT-2, Llama, Qwen2; sdpa and eager attention) in float64 on a
packed micro-batch and on the same conversations unpacked (one a row, right-padded, with an attention mask), and
compare every real position's logits, the per-token losses and the student's gradients.
"""

from __future__ import annotations

import dataclasses
import json

import datasets
import pytest
import torch
import torch.nn.functional as F
from launch import ROOT, run_ranks
from test_chat_data import SCRIPT, _assistant_perplexity, _chat_args, tiny_chat, tokenizer  # noqa: F401
from tiny_models import VOCAB, gpt2_config, llama_config, qwen2_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill_kit.data import chat
from distill_kit.data.blocks import IGNORE_INDEX
from distill_kit.errors import ConfigError
from losses.base import valid_positions

PAD = 0
BLOCK = 48  # the tiny models hold 64 positions


def conversations(count: int, seed: int, low: int = 3, high: int = 40) -> datasets.Dataset:
    """Random conversations in ChatSplits' columns: a prompt (labels -100) then a counted answer. Every third one
    counts from its first token on, which only packing's separator keeps from being predicted across rows."""
    generator = torch.Generator().manual_seed(seed)
    rows = {name: [] for name in chat.FEATURES}
    for i in range(count):
        n = int(torch.randint(low, high + 1, (1,), generator=generator))
        ids = torch.randint(1, VOCAB, (n,), generator=generator).tolist()
        prompt = 0 if i % 3 == 0 else int(torch.randint(1, n, (1,), generator=generator))
        labels = [IGNORE_INDEX] * prompt + ids[prompt:]
        counted = sum(label != IGNORE_INDEX for label in labels)
        for name, value in zip(chat.FEATURES, (ids, labels, n, counted, f"record {i}"), strict=True):
            rows[name].append(value)
    return datasets.Dataset.from_dict(rows, features=chat.FEATURES)


# ---- packing rows -----------------------------------------------------------------------------------------


def test_pack_lengths_places_every_conversation_once_within_capacity():
    lengths = [int(n) for n in torch.randint(1, 100, (500,), generator=torch.Generator().manual_seed(0))]
    rows = chat.pack_lengths(lengths, 128, seed=3)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    assert rows == chat.pack_lengths(lengths, 128, seed=3)  # deterministic: every rank computes the same rows
    # Best-fit decreasing on 500 lengths uniform in 1..99: within a row of the lower bound sum / capacity.
    assert len(rows) <= -(-sum(lengths) // 128) + 1
    with pytest.raises(ValueError, match="conversation 1 has 9 tokens, more than a packed row's 8"):
        chat.pack_lengths([3, 9], 8)


def test_packed_batch_restarts_positions_and_separates_labels():
    first = ([5, 6, 7], [5, 6, 7])  # counts from its first token: that label becomes -100 (the separator)
    second = ([8, 9], [IGNORE_INDEX, 9])
    third = ([4, 4, 4, 4], [IGNORE_INDEX, IGNORE_INDEX, 4, 4])
    batch = chat.packed_batch([[first, second], [third]], pad_id=PAD)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no 2-D mask: transformers masks by position_ids
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 4, 4, 4, PAD]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, -100, 4, 4, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]


# ---- exactness against unpacked rows ----------------------------------------------------------------------

MODELS = {"gpt2": lambda: gpt2_config(width=32, layers=2), "llama": llama_config, "qwen2": qwen2_config}


def _model(kind: str, attention: str, seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(MODELS[kind](), attn_implementation=attention,
                                            dtype=torch.float64).eval()


def _per_token(student_logits, teacher_logits, batch):
    """Float64 cross-entropy and KL(teacher || student) at each counted position, in row-major order."""
    positions = valid_positions(batch)
    target = torch.roll(batch["labels"], -1, dims=1)[positions]
    s_logp = F.log_softmax(student_logits[positions], dim=-1)
    t_logp = F.log_softmax(teacher_logits[positions], dim=-1)
    nll = -s_logp.gather(1, target[:, None]).squeeze(1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    return nll, kl


def _spans(batch, members):
    """(row, start, end) of each conversation of a packed batch, in order, found from its restarting positions:
    row ``r`` holds ``len(members[r])`` conversations, then at most one padding segment."""
    spans = []
    for row, positions in enumerate(batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        assert len(starts) - 1 in (len(members[row]), len(members[row]) + 1)
        spans += [(row, a, b) for a, b in zip(starts, starts[1:], strict=False)][: len(members[row])]
    return spans


def _assert_same(got: torch.Tensor, expected: torch.Tensor, kind: str, attention: str) -> None:
    """Packed equals unpacked up to the rounding of the precision the attention runs in.

    Float64 throughout (GPT-2; sdpa): the two forwards differ only in the lengths the matmuls and softmaxes reduce
    over (a packed row of up to 48 keys, masked, against a padded row of up to 40), i.e. a few float64 ulps of
    values of size ~1-10; 1e-10 leaves a wide margin. Llama's and Qwen2's eager attention take the softmax in float32
    (``softmax(..., dtype=torch.float32)``): its backward sums up to 48 float32 products per row, so the bound is
    48 float32 eps (1.2e-7) times the largest value compared (5.7e-6 relative). One token attended across a
    boundary moves logits by ~1e-2 (the controls below), far past either bound.
    """
    if attention == "eager" and kind in ("llama", "qwen2"):
        atol = 48 * torch.finfo(torch.float32).eps * float(expected.detach().abs().max())
    else:
        atol = 1e-10
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_packed_batch_gives_the_unpacked_per_token_losses_and_gradients(kind, attention):
    data = conversations(14, seed=1)
    loader = chat.ChatLoader(data, 3, pad_id=PAD, shuffle=False, drop_last=False, packing=True, block_size=BLOCK)
    teacher, student = _model(kind, attention, 0), _model(kind, attention, 1)
    checked = 0
    for index in range(len(loader)):
        packed = loader.batch(0, index)
        members = [loader.packed_rows[r] for r in loader.epoch_order(0)[index * 3 : index * 3 + 3]]
        members += [[]] * (3 - len(members))  # evaluation's filler rows: a padding segment only
        flat = [i for row in members for i in row]
        unpacked = chat.pad_rows(data[flat]["input_ids"], data[flat]["labels"], PAD)

        student.zero_grad()
        with torch.no_grad():
            t_packed = teacher(input_ids=packed["input_ids"], **chat.packed_model_inputs(packed)).logits
            t_plain = teacher(input_ids=unpacked["input_ids"], attention_mask=unpacked["attention_mask"]).logits
        s_packed = student(input_ids=packed["input_ids"], **chat.packed_model_inputs(packed)).logits
        nll_p, kl_p = _per_token(s_packed, t_packed, packed)
        (nll_p.sum() + kl_p.sum()).backward()
        grad_packed = [p.grad.clone() for p in student.parameters()]
        student.zero_grad()
        s_plain = student(input_ids=unpacked["input_ids"], attention_mask=unpacked["attention_mask"]).logits
        nll_u, kl_u = _per_token(s_plain, t_plain, unpacked)
        (nll_u.sum() + kl_u.sum()).backward()

        for conversation, (row, start, end) in zip(flat, _spans(packed, members), strict=True):
            n = data[conversation]["length"]
            assert end - start == n
            for packed_logits, plain in ((s_packed, s_plain), (t_packed, t_plain)):
                _assert_same(packed_logits[row, start:end], plain[flat.index(conversation), :n], kind, attention)
        assert nll_p.numel() == nll_u.numel() == int(valid_positions(unpacked).sum())
        # Same tokens in the same order: conversations are laid out in the same order in both batches.
        _assert_same(nll_p, nll_u, kind, attention)
        _assert_same(kl_p, kl_u, kind, attention)
        for got, parameter in zip(grad_packed, student.parameters(), strict=True):
            _assert_same(got, parameter.grad, kind, attention)
        checked += sum(len(row) > 1 for row in members)
    assert checked >= 3  # rows that really hold several conversations were compared

    # Controls: the same packed rows with a 2-D all-ones mask, or with the cache a model under no_grad builds by
    # default, leak attention across conversations (transformers then does not look for packing); the
    # comparison above would catch either.
    packed = loader.batch(0, 0)
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    with torch.no_grad():
        exact = teacher(**inputs, use_cache=False).logits
        for leaky in ({"use_cache": False, "attention_mask": torch.ones_like(packed["input_ids"])},
                      {"use_cache": True}):
            assert (teacher(**inputs, **leaky).logits - exact).abs().max() > 1e-3


# ---- counting and ranks -----------------------------------------------------------------------------------


def _all_batches(loader: chat.ChatLoader) -> list[dict]:
    return list(loader)


def test_packing_counts_the_same_tokens_as_unpacked_rows():
    data = conversations(40, seed=2)
    packed = chat.ChatLoader(data, 2, pad_id=PAD, shuffle=False, drop_last=False, packing=True, block_size=BLOCK)
    plain = chat.ChatLoader(data, 2, pad_id=PAD, shuffle=False, drop_last=False)
    counted = [sum(int(valid_positions(b).sum()) for b in _all_batches(loader)) for loader in (packed, plain)]
    assert counted[0] == counted[1] == sum(n - 1 if c == n else c for n, c in zip(data["length"], data["counted"],
                                                                                     strict=True))
    assert len(packed) < len(plain)  # fewer rows: several conversations each


@pytest.mark.parametrize("drop_last", [True, False])
def test_two_ranks_run_the_same_number_of_packed_micro_batches_over_disjoint_rows(drop_last):
    data = conversations(60, seed=3)
    ranks = [chat.ChatLoader(data, 2, pad_id=PAD, rank=r, world_size=2, seed=5, drop_last=drop_last, packing=True,
                             block_size=BLOCK) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) > 0
    rows = len(ranks[0].packed_rows)
    for epoch in (0, 1):
        seen = [[], []]
        for r, loader in enumerate(ranks):
            order = loader.epoch_order(epoch)
            assert order == ranks[0].epoch_order(epoch)  # every rank computes the same order
            for index in range(len(loader)):
                batch = loader.batch(epoch, index, order)
                assert batch["input_ids"].shape[0] == 2 and batch["input_ids"].shape[1] <= BLOCK
                start = (index * 2 + r) * 2
                seen[r] += [i for row in order[start : start + 2] for i in loader.packed_rows[row]]
        assert not set(seen[0]) & set(seen[1])
        whole = rows // 4 * 4 if drop_last else rows
        assert len(seen[0]) + len(seen[1]) == sum(len(ranks[0].packed_rows[row])
                                                  for row in ranks[0].epoch_order(epoch)[:whole])
    if not drop_last:  # every conversation once per epoch
        assert sorted(seen[0] + seen[1]) == list(range(60))


def test_a_resumed_packed_loader_continues_with_the_same_batch():
    data = conversations(60, seed=4)
    make = lambda: chat.ChatLoader(data, 2, pad_id=PAD, seed=1, packing=True, block_size=BLOCK)  # noqa: E731
    first = make()
    iterator = iter(first)
    next(iterator), next(iterator)
    state = first.state_dict()
    expected = next(iterator)
    resumed = make()
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_too_few_packed_rows_for_a_global_batch_is_a_config_error():
    data = conversations(6, seed=5, low=3, high=6)  # at most 36 tokens: one row of 48
    with pytest.raises(ConfigError, match=r"6 conversations packed into 1 rows of data.block_size 48 tokens but one "
                                          r"global batch needs world_size \(2\)"):
        chat.ChatLoader(data, 1, pad_id=PAD, world_size=2, packing=True, block_size=BLOCK)


def test_dataconfig_packing_defaults_to_none_and_text_still_joins_documents():
    from distill_kit.data.blocks import DataConfig

    config = DataConfig(train="x.jsonl")
    assert config.packing is None
    assert dataclasses.replace(config, packing=True).packing is True


# ---- the config and the CLI -------------------------------------------------------------------------------


def test_a_sampled_micro_batch_packs_to_the_same_losses_and_gradients():
    """``pack_padded`` (on-policy ``pack_to``): a right-padded micro-batch of prompt + answer rows, as the sampler
    leaves it, packed into rows of 24 tokens (one conversation longer than that gets its own row) and padded
    further to an agreed shape, gives the unpacked batch's total cross-entropy and KL and the student's gradients
    in float64 (GPT-2, sdpa; conversations are reordered by the bin packing, so totals are compared: to ~1e-12)."""
    torch.manual_seed(3)
    rows = []
    for n in (5, 9, 30, 12, 7, 16):
        ids = torch.randint(1, 90, (n,)).tolist()
        rows.append((ids, [IGNORE_INDEX] * (n // 2) + ids[n // 2:]))  # prompt, then the counted sample
    unpacked = chat.pad_rows([r[0] for r in rows], [r[1] for r in rows], PAD)
    seen = []  # the packing's own shape, as a rank offers it for agreement
    packed = chat.pack_padded(unpacked, 24, PAD, agree=lambda shape: seen.append(shape) or (shape[0] + 1, shape[1] + 3))
    (shape,) = seen
    assert packed["input_ids"].shape == (shape[0] + 1, shape[1] + 3) and shape[0] < len(rows)
    assert shape[1] == 30  # the 30-token conversation alone in its row
    assert int(valid_positions(packed).sum()) == int(valid_positions(unpacked).sum())
    teacher, student = _model("gpt2", "sdpa", 0), _model("gpt2", "sdpa", 1)
    totals, grads = [], []
    for batch, inputs in ((packed, chat.packed_model_inputs(packed)), (unpacked, {"attention_mask":
                                                                               unpacked["attention_mask"]})):
        student.zero_grad()
        with torch.no_grad():
            t_logits = teacher(input_ids=batch["input_ids"], **inputs).logits
        nll, kl = _per_token(student(input_ids=batch["input_ids"], **inputs).logits, t_logits, batch)
        (nll.sum() + kl.sum()).backward()
        totals.append(torch.stack([nll.sum(), kl.sum()]))
        grads.append([p.grad.clone() for p in student.parameters()])
    torch.testing.assert_close(totals[0], totals[1], rtol=0, atol=1e-10)
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_packing_with_sampling_is_accepted_and_the_sampler_packs_after_it(tmp_path):
    """data.packing: true with on-policy sampling is a valid run (the CLI's loader hands unpacked rows to the
    sampler, which packs after sampling: the plan sets pack_to); with combine: route the plan refuses it before any
    work, from Python as from the CLI; a packed batch reaching a sampler from Python is refused, naming pack_to."""
    from distill_kit import StudentSpec, TeacherSpec, TrainingConfig
    from distill_kit.training.on_policy import OnPolicyConfig, Sampler
    from distill_kit.training.plan import DataFacts, make_plan

    gpt2_config(width=16, layers=1).save_pretrained(tmp_path / "teacher")
    teachers = [TeacherSpec(name=name, model=str(tmp_path / "teacher")) for name in ("a", "b")]
    packed = DataFacts(kind="chat", block_size=32, packing=True)

    def plan(combine: str, fraction: float):
        return make_plan([StudentSpec(name="s", init={"n_layer": 1})], teachers, combine=combine, world_size=1,
                         training=TrainingConfig(on_policy=OnPolicyConfig(fraction=fraction)), data=packed)

    assert plan("sum", 0.5).training.on_policy.pack_to == 32
    with pytest.raises(ConfigError) as refused:
        plan("route", 0.0)
    assert str(refused.value) == ("data.packing: true with combine: route is not supported yet: a packed row would "
                                  "hold conversations of several teachers. Set data.packing: false, or combine: sum")
    batch = chat.packed_batch([[([5, 6], [IGNORE_INDEX, 6])]], PAD)
    with pytest.raises(ConfigError, match="a packed micro-batch reached the on-policy sampler .* set "
                                          "training.on_policy.pack_to"):
        Sampler(OnPolicyConfig(fraction=0.5), lambda: None)(batch)


def test_cli_trains_and_evaluates_on_packed_chat_data(tiny_chat, tmp_path):  # noqa: F811
    """One rank through the Distiller with data.packing: true: it trains, and the held-out perplexity of packed
    evaluation batches equals the exported student's, computed one conversation at a time unpacked."""
    out = tmp_path / "run"
    done = run_ranks(SCRIPT, [*_chat_args(tiny_chat, out), "data.packing=true"], nprocs=0)
    assert "conversations packed into" in done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    assert [e["step"] for e in report["evaluations"]] == [2, 4]
    for name in ("distilled", "no_teacher"):
        exported = _assistant_perplexity(out / "students" / name, tiny_chat["root"] / "heldout.jsonl")
        # float32 models: packed rows and single conversations round differently, ~1e-6 relative per logit.
        assert exported == pytest.approx(report["summary"]["students"][name]["perplexity"], rel=1e-4)


def test_cli_packs_the_sampled_micro_batches_of_an_on_policy_run(tiny_chat, tmp_path):  # noqa: F811
    """data.packing: true with on-policy sampling through the CLI: the loader hands unpacked rows to the sampler,
    which packs each sampled micro-batch into rows of data.block_size; the run trains and evaluates."""
    out = tmp_path / "run"
    eos = AutoTokenizer.from_pretrained(tiny_chat["teacher"]).eos_token_id  # the tiny teacher's config has GPT-2's
    args = [a for a in _chat_args(tiny_chat, out) if not a.startswith("[{name")][:-1]
    done = run_ranks(SCRIPT, [*args, "--students", "[{name: distilled, init: {n_layer: 1, n_embd: 32}}]",
                              "data.packing=true", "training.on_policy.fraction=0.5",
                              "training.on_policy.max_new_tokens=3", f"training.on_policy.eos_token_id={eos}"],
                     nprocs=0)
    log = done.stdout + done.stderr
    assert "sampled micro-batches are packed into rows of" in log
    report = json.loads((out / "report.json").read_text())
    assert [e["step"] for e in report["evaluations"]] == [2, 4]


def test_the_packing_benchmark_runs_on_the_cpu(tmp_path):
    """Smoke only (nothing about speed): every batching ran, and packing is the densest."""
    out = tmp_path / "bench.json"
    run_ranks(ROOT / "benchmarks/bench_packing.py", ["--pair", "tiny", "--conversations", "40", "--max-length", "256",
                                                    "--block-size", "256", "--micro-batch", "2", "--steps", "1",
                                                    "--warmup", "0", "--out", str(out)], nprocs=0)  # in this process
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"packed", "grouped", "random"}
    assert all(m["counted_tokens_per_s"] > 0 for m in modes.values())
    assert modes["packed"]["real_share"] > max(modes["grouped"]["real_share"], modes["random"]["real_share"])
