"""A sampled store (issue 41, RS-KD): K tokens drawn from the teacher per position, and forward KL's estimate from them.

Checked in float64 on small rows: the estimate's gradient, averaged over many independent draws, is the full forward
KL's gradient within a bound derived from the draws' variance, at temperatures 1 and 2, where top-k's (renormalised
or with the tail bucket) is not; the draws themselves (counts summing to K, log-probabilities at the temperature);
a store written with them reads back as the losses' sampled targets, and what it cannot serve (another divergence,
another temperature, K past the vocabulary or the counts' byte) is refused before anything loads or is written. In
process, no model but the tiny shipped teacher's config; ~2 s.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

import losses.functional as functional
from distill_kit.config import StudentSpec, TeacherSpec, TrainingConfig
from distill_kit.engines.models import model_config
from distill_kit.errors import ConfigError
from distill_kit.offline.capture import CaptureConfig, fill_store, sample, targets_of
from distill_kit.offline.captured_teacher import CapturedTeacher
from distill_kit.training.plan import make_plan
from losses import build_loss
from losses.sparse import SampledTeacherLogits, top_k_rows_loss

ROOT = Path(__file__).resolve().parents[1]
TEACHER = ROOT / "distill_kit" / "assets" / "default" / "teacher"
N, V, K, DRAWS = 4, 32, 8, 4000


def full_gradient(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    student = student.clone().requires_grad_(True)
    functional.forward_kl(student / temperature, teacher / temperature).sum().backward()
    return student.grad


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_sampled_estimate_is_unbiased_where_top_k_is_not(temperature):
    """Per draw the gradient w.r.t. the student's logits is ``(q - w) / T`` with ``w_v = c_v / K`` and ``c`` the
    multinomial counts, so each component's variance is ``p_v (1 - p_v) / (K T^2)`` and the mean of ``DRAWS``
    independent draws has standard deviation ``sigma_v = sqrt(p_v (1 - p_v) / (K DRAWS)) / T``. The bound is
    ``6 sigma_v + 1e-12`` per component (N x V = 128 of them: the chance that any true mean lands past 6 sigma is
    ~128 x 2e-9; 1e-12 is float64 rounding, far below). Top-k's gradient is deterministic: no number of draws brings
    it nearer, and its bias is more than 10x that bound on some component."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(N, V, generator=g, dtype=torch.float64) * 2.0
    student = torch.randn(N, V, generator=g, dtype=torch.float64)
    want = full_gradient(student, teacher, temperature)

    values, ids, counts = sample(teacher.repeat(DRAWS, 1), K, temperature, g)
    assert bool((counts.sum(-1) == K).all()) and values.dtype == torch.float64
    log_p = torch.log_softmax(teacher / temperature, -1).repeat(DRAWS, 1)
    used = counts > 0
    assert torch.equal(values[used], log_p.gather(-1, ids)[used])  # the teacher's log p at T of each drawn id
    repeated = student.repeat(DRAWS, 1).requires_grad_(True)
    functional.sampled_forward_kl(repeated / temperature, values, ids, counts).sum().backward()
    got = repeated.grad.reshape(DRAWS, N, V).mean(0)

    p = torch.softmax(teacher / temperature, -1)
    bound = 6 * (p * (1 - p) / (K * DRAWS)).sqrt() / temperature + 1e-12
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())

    top_values, top_ids = torch.log_softmax(teacher, -1).topk(K, -1)  # a top-k store's rows at the same K
    tail = torch.log_softmax(teacher, -1).scatter(-1, top_ids, -math.inf).logsumexp(-1)
    per_token = functional.forward_kl
    for log_tail in ((None,) if temperature != 1.0 else (None, tail)):  # the tail bucket is exact at T = 1 only
        top = student.clone().requires_grad_(True)
        top_k_rows_loss(top, top_values, top_ids, log_tail, None, per_token=lambda s, t, _: per_token(s, t),
                        temperature=temperature).sum().backward()
        assert float(((top.grad - want).abs() / bound).max()) > 10  # far outside the bound the draws' mean meets


def test_a_sampled_store_reads_back_as_sampled_targets_and_the_plan_refuses_what_it_cannot_serve(tmp_path):
    teacher_config = model_config(str(TEACHER))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 1024, (3, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.tensor([12, 7, 12])[:, None]).long()
    blocks = datasets.Dataset.from_dict({"input_ids": (ids * mask).tolist(), "attention_mask": mask.tolist(),
                                         "labels": ids.masked_fill(mask == 0, -100).tolist()})
    logits = torch.randn(3, 12, 1024, generator=g) * 3  # a stand-in teacher's, a pure function of the block
    config = CaptureConfig(k=12, values_dtype="fp32", micro_batch_size=2, targets="sampled", temperature=2.0)

    def rows(batch, real):
        keep = batch["attention_mask"][:real].bool()
        index = [int(((ids * mask) == row).all(-1).nonzero()[0]) for row in batch["input_ids"][:real]]
        return (*targets_of(logits[index][keep], batch["input_ids"][:real], config), {})

    manifest = fill_store(rows, "stand-in", "sha", teacher_config.to_dict(), None, blocks, tmp_path / "store", config)
    assert (manifest.spec.targets, manifest.spec.temperature) == ("sampled", 2.0)
    # 12 x (2 bytes an id at a 1,024 vocabulary + 1 count + 4 float32 values): 84 bytes a token (fp16: 60)
    assert manifest.stats["top_k_bytes_per_token"] == 12 * (2 + 1 + 4)
    captured = CapturedTeacher(tmp_path / "store")
    batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": (ids * mask).masked_fill(mask == 0, -100)}
    out = captured(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert isinstance(out, SampledTeacherLogits) and out.temperature == 2.0
    assert bool((out.counts.sum(-1)[mask.bool()] == 12).all())
    student = SimpleNamespace(logits=torch.randn(3, 12, 1024, generator=g))
    teacher = SimpleNamespace(logits=out)
    assert torch.isfinite(build_loss({"name": "forward_kl", "temperature": 2.0})(student, teacher, batch).total)
    with pytest.raises(ValueError, match="ReverseKL cannot use a sampled teacher store.*Use forward_kl"):
        build_loss({"name": "reverse_kl", "temperature": 2.0})(student, teacher, batch)
    with pytest.raises(ValueError, match="temperature 1.0, and the teacher's tokens were sampled at temperature 2.0"):
        build_loss({"name": "forward_kl"})(student, teacher, batch)

    store = TeacherSpec(name="t", model=str(tmp_path / "store"))
    plan = make_plan([StudentSpec(name="s", model=str(TEACHER), loss={"name": "forward_kl", "temperature": 2.0})],
                     [store], training=TrainingConfig(), world_size=1, tokenizer=str(TEACHER))
    assert plan.cards["t"].sample_temperature == 2.0
    for loss, match in (({"name": "forward_kl"}, r"temperature 1, and teacher 't''s tokens were sampled at "
                                                 r"temperature 2: set the loss's temperature to 2, or capture"),
                        ({"name": "total_variation", "temperature": 2.0}, "only forward KL has an unbiased")):
        with pytest.raises(ConfigError, match=match):
            make_plan([StudentSpec(name="s", model=str(TEACHER), loss=loss)], [store], training=TrainingConfig(),
                      world_size=1, tokenizer=str(TEACHER))
    for bad, match in (({"k": 300, "targets": "sampled"}, "<= 255 for a sampled store"),
                       ({"temperature": 0.5}, "a top-k store keeps"),
                       ({"temperature": 0.0, "targets": "sampled"}, "temperature must be > 0")):
        with pytest.raises(ValueError, match=match):
            CaptureConfig(**bad)


def test_the_capture_script_refuses_k_past_the_vocabulary_or_the_counts_byte_before_anything_loads(tmp_path,
                                                                                                   monkeypatch):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("capture_teacher", ROOT / "scripts/capture_teacher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for extra, match in ((["--k", "2000"], r"--k 2000: above the teacher's vocabulary \(1024 tokens\); give --k 1024"),
                         (["--targets", "sampled", "--k", "300"], "<= 255 for a sampled store"),
                         (["--temperature", "2"], "a top-k store keeps log-probabilities at temperature 1")):
        monkeypatch.setattr(sys, "argv", ["capture_teacher.py", "--teacher", str(TEACHER), "--data", "x.txt",
                                          "--out", str(tmp_path / "store"), *extra])
        with pytest.raises(ConfigError, match=match):
            module.run(module.parse_args())
    assert not (tmp_path / "store").exists()


def test_a_sampled_capture_from_vllm_is_refused_naming_what_it_gives(tmp_path):
    from distill_kit.teachers import served_capture

    config = CaptureConfig(k=12, targets="sampled")
    with pytest.raises(ConfigError, match="--targets sampled from --teacher http://127.0.0.1:9: .* a vllm server "
                                          "gives top-k log-probabilities: capture --targets top_k"):
        served_capture.capture("http://127.0.0.1:9", None, None, tmp_path / "store", config, {"api": "vllm"})
    assert not (tmp_path / "store").exists()
