"""On-policy settings that need no ranks: kernel choices when the student samples, the SDPA switch while it
decodes, and bad values. (Sampling and training on real engines: test_on_policy.py.)"""

import os

import pytest

from distill_kit.engines import kernels
from distill_kit.training import on_policy
from distill_kit.training.on_policy import OnPolicyConfig


def test_a_sampling_student_gets_no_auto_liger_and_its_teacher_no_liger_rope(caplog):
    sampling = OnPolicyConfig(fraction=0.5)
    assert on_policy.student_kernels("auto", sampling) == "none"
    assert not caplog.records
    assert on_policy.student_kernels("liger", sampling) == "liger"  # asked for by name: kept, its cost said
    assert "auto leaves Liger out of a sampling student" in caplog.text
    caplog.clear()
    assert kernels.teacher_liger(sampling) == {"rope": False}
    for other in (OnPolicyConfig(), OnPolicyConfig(fraction=1.0, sampler="teacher")):  # off-policy, seq-KD
        assert on_policy.student_kernels("auto", other) == "auto"
        assert on_policy.student_kernels("liger", other) == "liger"
        assert kernels.teacher_liger(other) == {}
    assert not caplog.records  # a student that does not sample runs Liger without a word


@pytest.mark.parametrize("before", [None, "0"])
def test_sdpa_gqa_switch_is_set_only_inside_and_restored(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(on_policy.FORCE_GQA, raising=False)
    else:
        monkeypatch.setenv(on_policy.FORCE_GQA, before)
    with pytest.raises(RuntimeError, match="inside"):
        with on_policy.sdpa_gqa(True):
            assert os.environ[on_policy.FORCE_GQA] == "1"
            raise RuntimeError("inside")
    assert os.environ.get(on_policy.FORCE_GQA) == before
    with on_policy.sdpa_gqa(False):
        assert os.environ.get(on_policy.FORCE_GQA) == before


def test_negative_generation_batch_size_is_refused():
    with pytest.raises(ValueError, match=r"on_policy.generation_batch_size=-1 .*generation_batch_size >= 0"):
        OnPolicyConfig(fraction=1.0, generation_batch_size=-1)


def test_samples_are_cut_to_fit_the_row_limit_and_the_cut_is_logged(caplog):
    """A 12-position model samples after prompts of 5 and 9 tokens with max_new_tokens far past its positions: every
    row (prompt + sample) fits, and the log says so; max_length, when given, is the limit instead."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=12,
                                       eos_token_id=39, pad_token_id=0))
    prompts = [torch.arange(1, 6), torch.arange(1, 10)]
    sampler = on_policy.Sampler(OnPolicyConfig(fraction=1.0, max_new_tokens=1000, eos_token_id=39), lambda: model)
    with caplog.at_level("WARNING"):
        samples = sampler.generate(prompts)
    assert all(9 + len(s) <= 12 for s in samples) and any(len(s) > 0 for s in samples)
    assert "on-policy samples capped at 3 new tokens" in caplog.text and "the 12 positions" in caplog.text
    limited = on_policy.Sampler(OnPolicyConfig(fraction=1.0, max_new_tokens=1000, eos_token_id=39, max_length=10),
                                lambda: model)
    assert all(len(s) <= 1 for s in limited.generate(prompts))
    assert [len(s) for s in limited.generate([torch.arange(1, 11)])] == [0]  # a prompt that fills the limit


def test_text_rows_answer_their_first_prompt_tokens_and_without_them_are_refused():
    """``on_policy.prompt_tokens``: a text row (every token counted) keeps its first tokens as the prompt and the
    sample replaces the rest, labels on the sample only; a shorter (padded) row keeps what it has. Without
    ``prompt_tokens`` such a row has no prompt, and the sampler says what to set instead of generating from nothing
    (the CLI refuses text data without it before any work: ``test_start_checks.py::test_on_policy_rules``)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from distill_kit.errors import ConfigError

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                       eos_token_id=39, pad_token_id=0)).eval()
    ids = torch.arange(1, 25).reshape(2, 12)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # the second row is 6 tokens long
    batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    config = OnPolicyConfig(fraction=1.0, max_new_tokens=5, temperature=0.0, prompt_tokens=8, eos_token_id=39)
    out = on_policy.Sampler(config, lambda: model)(batch)
    for row, kept in ((0, 8), (1, 6)):
        assert torch.equal(out["input_ids"][row, :kept], batch["input_ids"][row, :kept])
        assert (out["labels"][row, :kept] == -100).all()
        expected = model.generate(ids[row:row + 1, :kept], attention_mask=torch.ones(1, kept, dtype=torch.long),
                                  do_sample=False, max_new_tokens=5, eos_token_id=39, pad_token_id=0)[0, kept:]
        sample = out["labels"][row][out["labels"][row] != -100]
        assert sample.tolist() == expected.tolist() and len(sample) > 0  # the greedy continuation, counted
    with pytest.raises(ConfigError, match="set training.on_policy.prompt_tokens"):
        on_policy.Sampler(OnPolicyConfig(fraction=1.0, max_new_tokens=5, eos_token_id=39), lambda: model)(batch)


def test_a_model_compiled_layer_by_layer_samples_eagerly():
    """A teacher whose decoder layers are compiled (an FP8 teacher's default kernels) generates eagerly: with a
    cache, each layer would recompile for its own cache state (dynamo's counting backend sees no compile at all),
    and the samples are the uncompiled model's."""
    import torch
    from tiny_models import qwen2_config
    from torch._dynamo.testing import CompileCounter
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(num_hidden_layers=3)).eval()
    config = OnPolicyConfig(fraction=1.0, max_new_tokens=6, eos_token_id=1, temperature=0.0)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    plain = on_policy.Sampler(config, lambda: model).generate(prompts)
    torch._dynamo.reset()
    counter = CompileCounter()
    for layer in model.model.layers:
        layer.compile(backend=counter)
    compiled = on_policy.Sampler(config, lambda: model).generate(prompts)
    assert counter.frame_count == 0
    assert all(torch.equal(a, b) for a, b in zip(plain, compiled, strict=True))
    torch._dynamo.reset()


def test_sampled_rows_keep_their_teacher():
    """Routed on-policy (combine: route): a row's sample is scored by the teacher its record names, so the sampled
    batch keeps every row's teacher_id in place while its tokens and labels become prompt + sample."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, eos_token_id=39))
    ids = torch.randint(1, 39, (4, 6))
    labels = ids.clone()
    labels[:, :3] = -100  # three prompt tokens, three answer tokens
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
             "teacher_id": torch.tensor([1, 0, 0, 1])}
    sampler = on_policy.Sampler(OnPolicyConfig(fraction=1.0, max_new_tokens=4, eos_token_id=39, pad_token_id=0),
                                lambda: model)
    out = sampler(batch)
    assert torch.equal(out["teacher_id"], batch["teacher_id"])
    assert torch.equal(out["input_ids"][:, :3], ids[:, :3])  # each row is still its own prompt's
    assert (out["labels"][:, :3] == -100).all() and (out["labels"] != -100).any()
