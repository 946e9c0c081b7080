"""The fused non-finite-gradient check (``engines/overflow.py``) answers as DeepSpeed's own per-tensor check does.

A bf16 ZeRO-2 engine on the CPU (gloo), one backward; then each case writes one value into one partitioned
gradient and asks both checks. The answer is a boolean, so equality is exact. A step after a NaN gradient must be
discarded with the fused check as with DeepSpeed's (the weights unchanged): what ``training/nonfinite.py`` relies on.
The one-kernel gradient norm (``fuse_grad_norm``, applied on CUDA only) is called here directly on the same engine's
gradients and compared with DeepSpeed's per-tensor norm.
"""

from __future__ import annotations

import deepspeed
import pytest
import torch
from tiny_models import gpt2_config
from transformers import GPT2LMHeadModel

from distill_kit.engines import distributed, overflow


@pytest.fixture(scope="module")
def engine():
    distributed.init()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(16, 2)).to(torch.bfloat16)
    config = {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert overflow.fuse_overflow_check(engine)
    return engine


def backward(engine) -> None:
    ids = torch.arange(16).reshape(2, 8) % 50
    engine.backward(engine(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), None])
@pytest.mark.parametrize("where", [0, -1])
def test_the_fused_check_answers_as_deepspeeds(engine, value, where):
    backward(engine)
    grads = engine.optimizer.averaged_gradients[0]
    if value is not None:
        grads[where].view(-1)[-1] = value
    deepspeeds = type(engine.optimizer).has_overflow_partitioned_grads_serial(engine.optimizer)
    fused = engine.optimizer.has_overflow_partitioned_grads_serial()
    assert bool(fused) == bool(deepspeeds) == (value is not None)
    assert fused.shape == deepspeeds.shape == (1,)
    engine.optimizer.zero_grad(set_to_none=True)
    engine.optimizer.averaged_gradients[0] = None


def test_a_nan_gradient_is_still_discarded(engine):
    before = [p.detach().clone() for p in engine.module.parameters()]
    backward(engine)
    engine.optimizer.averaged_gradients[0][3].view(-1)[0] = float("nan")
    engine.step()
    assert engine.optimizer.overflow
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters(), strict=True))
    backward(engine)  # and a finite one is taken
    engine.step()
    assert not engine.optimizer.overflow
    assert not all(torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters(), strict=True))


def test_the_one_kernel_gradient_norm_is_deepspeeds_norm(engine):
    """Both take each tensor's 2-norm in fp64 (sums of exactly squared bf16 values); DeepSpeed then sums the squares
    of those norms in fp64, the fused path takes the fp64 2-norm of their vector and DeepSpeed squares it again.
    Those fp64 results differ by a few fp64 ulps (~1e-15 relative), far below one float32 ulp, so after DeepSpeed's
    cast to float32 and square root they are equal or one float32 ulp apart: relative 2**-23 at most."""
    backward(engine)
    optimizer = engine.optimizer
    grads, params = optimizer.averaged_gradients[0], optimizer.params_in_partition[0]
    deepspeeds = type(optimizer).get_grad_norm_direct(optimizer, grads, params)
    fused = overflow._fused_norm(optimizer, grads, params)
    assert fused.dtype == deepspeeds.dtype == torch.float32
    assert deepspeeds > 0
    torch.testing.assert_close(fused, deepspeeds, rtol=2**-23, atol=0)
    # a gradient that is ZeRO's alignment padding counts in neither
    padding = torch.full_like(grads[0], 1e3)
    padding._zero_padding = True
    torch.testing.assert_close(overflow._fused_norm(optimizer, [padding, *grads], params), deepspeeds,
                               rtol=2**-23, atol=0)
    engine.optimizer.zero_grad(set_to_none=True)
    engine.optimizer.averaged_gradients[0] = None


def test_the_one_kernel_norm_is_for_cuda_only(engine):
    """On the CPU ``_foreach_norm`` is a per-tensor loop itself: the CPU's runs keep DeepSpeed's arithmetic."""
    assert not overflow.fuse_grad_norm(engine)
    assert "get_grad_norm_direct" not in vars(engine.optimizer)
