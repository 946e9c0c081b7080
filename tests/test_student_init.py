"""A fresh student built from the teacher's config with ``init`` overrides: head_dim follows the new shape."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

from distill_kit.config import StudentSpec
from distill_kit.errors import ConfigError
from distill_kit.run.cli import prepare_student
from distill_kit.run.run_config import RunConfig


def teacher(tmp_path, **shape):
    """A Llama teacher config with head_dim stored explicitly, as saved configs have it."""
    config = LlamaConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=96, num_hidden_layers=1, **shape)
    config.save_pretrained(tmp_path / "teacher")
    return RunConfig(teacher=str(tmp_path / "teacher"), output_dir=str(tmp_path / "run"))


def built(run: RunConfig, init: dict):
    spec = prepare_student(StudentSpec(name="s", init=init), run, tokenizer=None)
    return AutoModelForCausalLM.from_pretrained(spec.model)


@pytest.mark.parametrize("init, head_dim", [
    ({"hidden_size": 48, "num_attention_heads": 2, "num_key_value_heads": 2}, 24),
    ({"hidden_size": 32}, 8),  # 4 heads kept
    ({"num_attention_heads": 2, "num_key_value_heads": 2}, 32),
    ({"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}, 8),  # given: kept
    ({"num_hidden_layers": 2}, 16),  # shape unchanged: the teacher's
])
def test_head_dim_follows_the_students_width_and_heads(tmp_path, init, head_dim):
    model = built(teacher(tmp_path, head_dim=16), init)
    assert model.config.head_dim == head_dim
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.out_features == model.config.num_attention_heads * head_dim


def test_a_width_the_heads_do_not_divide_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"students\[s\]\.init: hidden_size 30 is not divisible by "
                                          r"num_attention_heads 4"):
        built(teacher(tmp_path, head_dim=16), {"hidden_size": 30})
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_a_teacher_with_its_own_head_dim_needs_one_given(tmp_path):
    """head_dim 32 with 4 heads of width 64 is a deliberate choice; a new width cannot guess the student's."""
    with pytest.raises(ConfigError, match=r"teacher's head_dim \(32\) is not its hidden_size/num_attention_heads "
                                          r"\(64/4\); give head_dim too"):
        built(teacher(tmp_path, head_dim=32), {"hidden_size": 32})
    assert built(teacher(tmp_path, head_dim=32), {"hidden_size": 32, "head_dim": 32}).config.head_dim == 32
