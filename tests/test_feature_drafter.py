"""The feature-reading drafter (``students/feature_drafter.py``, EAGLE-3's design) against its definition.

Greedy speculative decoding with it returns exactly the target's greedy tokens; the training-time-test unroll is
the step-by-step chain that decoding runs (the first step on the target's features, each later one on the drafter's
own previous hidden state); the greedy rounds taken from one unroll are the decoding loop's rounds; the exported
folder has EAGLE-3's weight names and loads back to the same drafter. Float64 tiny models: the comparisons are
exact up to float64 rounding of a few sums (1e-10 is far above it and far below any logit gap that matters).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

import losses.functional as functional
from distill_kit.students.feature_drafter import FeatureDrafter, default_layers
from distill_kit.training import speculative
from tests.tiny_models import llama_config, qwen2_config


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """A 5-token-vocabulary teacher and a feature drafter on it fitted for a few steps (forward KL, two unrolled
    steps), so that rounds keep drafts, float64."""
    torch.manual_seed(0)
    cls, config = (LlamaForCausalLM, llama_config) if request.param == "llama" else (Qwen2ForCausalLM, qwen2_config)
    teacher = cls(config(num_hidden_layers=6, vocab_size=5, pad_token_id=0, bos_token_id=0,
                         eos_token_id=0)).double().eval()
    drafter = FeatureDrafter(teacher).double()
    optimizer = torch.optim.Adam(drafter.trainable_parameters(), lr=1e-2)
    text = torch.randint(0, 5, (8, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = teacher(input_ids=text, output_hidden_states=True)
    for _ in range(30):
        loss = sum(functional.forward_kl(step.logits, out.logits).mean()
                   for step in drafter.unrolled(text, out.hidden_states, steps=2))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert teacher.model.embed_tokens.weight.grad is None  # the teacher's weights stay out of the drafter's update
    return teacher, drafter.eval()


def prompts(count: int, vocab: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (5,), generator=generator) for _ in range(count)]


def test_it_reads_the_teachers_low_middle_and_high_layers_and_shares_its_embedding_and_head(pair):
    teacher, drafter = pair
    assert drafter.layers == default_layers(6) == (2, 3, 3)
    assert drafter.embed_tokens is teacher.model.embed_tokens and drafter.lm_head is teacher.lm_head
    trainable = {name for name, p in drafter.named_parameters() if p.requires_grad}
    assert trainable and not any(name.startswith(("embed_tokens", "lm_head")) for name in trainable)
    hidden = teacher.config.hidden_size
    assert drafter.fc.weight.shape == (hidden, 3 * hidden)
    assert drafter.midlayer.self_attn.q_proj.in_features == 2 * hidden
    assert type(drafter.midlayer) is type(teacher.model.layers[0])  # transformers' own decoder layer


@torch.no_grad()
def test_the_unroll_is_the_chain_decoding_runs(pair):
    teacher, drafter = pair
    text = torch.randint(0, 5, (1, 12), generator=torch.Generator().manual_seed(1))
    hidden_states = teacher(input_ids=text, output_hidden_states=True).hidden_states
    steps = drafter.unrolled(text, hidden_states, steps=3)
    assert torch.allclose(steps[0].logits, drafter(text, teacher_hidden_states=hidden_states).logits, atol=1e-10)
    for last in (4, 7):  # a round whose verified text ends at index `last`
        features, row = drafter.teacher_features(hidden_states)[:, :last + 1], text[:, :last + 1]
        for m in range(1, 4):  # draft m at position last + m - 1, on its own earlier hidden states
            out = drafter(row, features=features)
            assert torch.allclose(out.logits[0, -1], steps[m - 1].logits[0, last + m - 1], atol=1e-10)
            features = torch.cat([features, out.hidden[:, -1:]], dim=1)
            row = text[:, :last + m + 1]


@torch.no_grad()
def test_greedy_decoding_returns_the_targets_tokens_and_one_unroll_gives_its_rounds(pair):
    teacher, drafter = pair
    kept_any = False
    for prompt in prompts(2):
        expected = teacher.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
                                    max_new_tokens=12, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        for gamma in (3,):
            decoded = speculative.speculative_decode(teacher, drafter, prompt, gamma=gamma, max_new_tokens=12)
            assert decoded.tokens.tolist() == expected.tolist()
            assert speculative.greedy_accepted(teacher, drafter, prompt, gamma=gamma,
                                               max_new_tokens=12) == decoded.accepted
            kept_any |= any(decoded.accepted)
    assert kept_any  # the rounds compared keep drafts, so the check is not 0 == 0


def test_export_has_eagle3s_names_and_loads_back(pair, tmp_path):
    teacher, drafter = pair
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(drafter.layers)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
            "embed_tokens.weight"} <= names
    loaded = FeatureDrafter.from_pretrained(tmp_path, teacher).double().eval()
    text = torch.randint(0, 5, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden_states = teacher(input_ids=text, output_hidden_states=True).hidden_states
        assert torch.equal(loaded(text, teacher_hidden_states=hidden_states).logits,
                           drafter(text, teacher_hidden_states=hidden_states).logits)


# ---- as a student kind: the plan's refusals, and a run through the Distiller -------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from tiny_tokenizers import bpe

    tokenizer = bpe("d e", "de f")
    path = tmp_path_factory.mktemp("feature_teacher") / "teacher"
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(vocab_size=len(tokenizer), num_hidden_layers=6)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _plan(students, teachers, **training):
    from distill_kit import TrainingConfig
    from distill_kit.training.plan import make_plan

    return make_plan(students, teachers, training=TrainingConfig(max_steps=1, micro_batch_size=2, **training),
                     world_size=1)


def test_a_teacher_without_hidden_states_several_teachers_and_sampling_are_refused(llama_folder, monkeypatch):
    from distill_kit import StudentSpec, TeacherSpec
    from distill_kit.config import OnPolicyConfig
    from distill_kit.errors import ConfigError
    from distill_kit.teachers import served

    drafter = StudentSpec(name="eagle", feature_drafter={})
    teacher = TeacherSpec(name="t", model=str(llama_folder))
    assert _plan([drafter], [teacher]).student_configs["eagle"].model_type == "llama"  # the plain case plans
    config = LlamaForCausalLM.config_class.from_pretrained(llama_folder)
    monkeypatch.setattr(served, "server_info", lambda url, opts, named: {
        "vocab_size": config.vocab_size, "config": config.to_dict(), "max_top_k": 8})
    server = TeacherSpec(name="srv", model="http://127.0.0.1:9", kind="served",
                         options={"tokenizer": str(llama_folder)})
    with pytest.raises(ConfigError, match="cannot give its hidden states"):
        _plan([drafter], [server])
    with pytest.raises(ConfigError, match="exactly one teacher"):
        _plan([drafter], [teacher, TeacherSpec(name="u", model=str(llama_folder))])
    with pytest.raises(ConfigError, match="cannot sample on its own"):
        _plan([drafter], [teacher], on_policy=OnPolicyConfig(fraction=1.0, sampler="student"))
    with pytest.raises(ValueError, match="drop model"):
        StudentSpec(name="eagle", model=str(llama_folder), feature_drafter={})
    for steps in (0, 2.5, True):
        with pytest.raises(ValueError, match="feature_drafter.ttt_steps"):
            StudentSpec(name="eagle", feature_drafter={"ttt_steps": steps})


@pytest.mark.slow  # builds DeepSpeed engines: a few seconds, off the fast tier
def test_the_distiller_trains_evaluates_and_exports_it(llama_folder, tmp_path):
    from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig
    from distill_kit.config import SpeculativeConfig
    from distill_kit.run import report
    from tests.tiny_models import random_batches

    distiller = Distiller(students=[StudentSpec(name="eagle", feature_drafter={"layers": [1, 3, 5]})],
                          teachers=[TeacherSpec(model=str(llama_folder))],
                          training=TrainingConfig(max_steps=2, micro_batch_size=2, lr=1e-2),
                          speculative=SpeculativeConfig(prompts=2, gamma=2, max_new_tokens=4, prompt_tokens=4))
    drafter = distiller.students["eagle"].model
    assert drafter.layers == (1, 3, 5)
    before = {name: p.detach().clone() for name, p in drafter.named_parameters()}
    vocab = drafter.config.vocab_size
    history = distiller.train(iter(random_batches(2, 2, 12, seed=0, vocab=vocab)))
    assert history
    after = dict(drafter.named_parameters())
    assert not torch.equal(after["fc.weight"], before["fc.weight"])  # trained on the teacher's features
    assert torch.equal(after["embed_tokens.weight"], before["embed_tokens.weight"])  # the teacher's (tied): frozen
    figures = distiller.evaluate(random_batches(2, 2, 12, seed=1, vocab=vocab), max_batches=1)
    assert 1 <= figures["eagle"]["speculative_tau"] <= 3 and figures["eagle"]["perplexity"] > 0
    assert figures["eagle"]["speculative_method"] == "eagle3"
    summary = report.summarize(figures, {"eagle": "forward_kl"})
    report.add_drafting(summary, {"name": "teacher", "model": "/models/t", "sha256": "ab"}, tmp_path / "students")
    assert "--speculative-algorithm EAGLE3" in summary["students"]["eagle"]["serve"]["sglang"]
    assert '"method": "eagle3"' in summary["students"]["eagle"]["serve"]["vllm"]
    folder = distiller.export(tmp_path / "students")["eagle"]
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


@pytest.mark.slow  # builds DeepSpeed engines: a few seconds, off the fast tier
def test_the_distillers_step_trains_the_unrolled_draft_steps(llama_folder):
    """``feature_drafter.ttt_steps: 3``: the step's loss is EAGLE-3's training-time test, each unrolled draft step's
    forward KL to the teacher (masked per-token mean) weighted 0.8 ** (m - 1) and summed, against a float64
    reference on the same weights; each later step's loss is logged."""
    from transformers import AutoModelForCausalLM

    from distill_kit import Distiller, StudentSpec, TeacherSpec, TrainingConfig
    from tests.tiny_models import random_batches

    distiller = Distiller(students=[StudentSpec(name="eagle", feature_drafter={"ttt_steps": 3})],
                          teachers=[TeacherSpec(model=str(llama_folder))],
                          training=TrainingConfig(max_steps=1, micro_batch_size=2, lr=1e-2))
    drafter = distiller.students["eagle"].model
    assert drafter.ttt_steps == 3
    batch = random_batches(1, 2, 12, seed=0, vocab=drafter.config.vocab_size)[0]
    teacher = AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float64).eval()
    reference = copy.deepcopy(drafter).double()
    with torch.no_grad():
        out = teacher(input_ids=batch["input_ids"], output_hidden_states=True)
        steps = reference.unrolled(batch["input_ids"], out.hidden_states, steps=3)
    mask = torch.zeros_like(batch["labels"], dtype=torch.bool)
    mask[:, :-1] = batch["labels"][:, 1:] != -100
    log_p = out.logits.log_softmax(-1)
    per_step = [((log_p.exp() * (log_p - step.logits.log_softmax(-1))).sum(-1) * mask).sum() / mask.sum()
                for step in steps]
    expected = sum(0.8 ** m * loss for m, loss in enumerate(per_step))

    loss = next(iter(distiller.training_step(batch).values()))
    # float32 engines against float64: per-token KLs of order 1 summed over ~20 positions and 3 steps, each off by
    # float32 rounding of 64-wide dot products and a 64-token softmax (~1e-6 relative): 1e-4 is far above that and
    # far below the 0.8 ** 2 weight of the third step (dropping or misweighting a step moves it by > 10%).
    assert float(loss.total.detach()) == pytest.approx(float(expected), rel=1e-4)
    assert float(loss.parts["draft_step_2"]) == pytest.approx(float(per_step[1]), rel=1e-4)
    assert float(loss.parts["draft_step_3"]) == pytest.approx(float(per_step[2]), rel=1e-4)
