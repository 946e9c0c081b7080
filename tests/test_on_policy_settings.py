"""On-policy settings that need no ranks: kernel choices when the student samples, the SDPA switch while it
decodes, and bad values. (Sampling and training on real engines: test_on_policy.py.)"""

import os

import pytest

from distill_kit.training import on_policy
from distill_kit.training.on_policy import OnPolicyConfig


def test_a_sampling_student_gets_no_auto_liger_and_its_teacher_no_liger_rope():
    sampling = OnPolicyConfig(fraction=0.5)
    assert on_policy.student_kernels("auto", sampling) == "none"
    assert on_policy.student_kernels("liger", sampling) == "liger"  # asked for by name: kept
    assert on_policy.teacher_liger(sampling) == {"rope": False}
    for other in (OnPolicyConfig(), OnPolicyConfig(fraction=1.0, sampler="teacher")):  # off-policy, seq-KD
        assert on_policy.student_kernels("auto", other) == "auto"
        assert on_policy.teacher_liger(other) == {}


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
