"""Peak device memory of one logit loss's forward + backward, ours (chunked) against the naive float32 one;
and of the student's head and the loss together (:func:`measure_with_head`), where ours is fused.

Both losses get the same bf16 logits (student with ``requires_grad``, teacher without), already in
memory before the measurement starts; what is reported is the peak *above* them, which includes the
bf16 gradient of the student logits that any implementation must produce. On the CPU there is no
allocator to read, so only the time and the loss values are reported.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch

from losses import DistillationLoss
from losses.fused import HeadOutput

GIB = 2**30


def _one(loss: DistillationLoss, shape: tuple[int, int, int], device: torch.device,
         dtype: torch.dtype) -> dict[str, Any]:
    batch_size, length, vocab = shape
    generator = torch.Generator(device=device).manual_seed(0)
    student = torch.randn(shape, device=device, dtype=dtype, generator=generator).requires_grad_(True)
    teacher = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    input_ids = torch.randint(0, vocab, (batch_size, length), device=device, generator=generator)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    out = loss(SimpleNamespace(logits=student), SimpleNamespace(logits=teacher), batch)
    out.total.backward()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) - before) / GIB if cuda else None
    return {"peak_above_inputs_gib": peak, "seconds": seconds, "loss": out.total.item()}


def measure(ours: dict[str, DistillationLoss], naive: DistillationLoss, shape: tuple[int, int, int],
            device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Each of ours (by name, e.g. one per chunk size), then naive, on fresh inputs and an emptied cache."""
    result: dict[str, Any] = {"tokens": shape[0] * shape[1], "batch": shape[0], "length": shape[1],
                              "vocab": shape[2], "dtype": str(dtype).removeprefix("torch.")}
    for name, loss in (*ours.items(), ("naive", naive)):
        result[name] = _one(loss, shape, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    naive_peak = result["naive"]["peak_above_inputs_gib"]
    result["over_naive"] = {name: None if naive_peak is None else result[name]["peak_above_inputs_gib"] / naive_peak
                            for name in ours}
    return result


def _one_with_head(loss: DistillationLoss, fused: bool, shape: tuple[int, int, int], hidden_size: int,
                   device: torch.device, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """The student's head and the loss together, from final hidden states: full logits then the loss, or fused.

    Repeated ``repeats`` times on the same inputs; the time is the last repeat's (the first compiles the fused
    chunk on CUDA), the peak the largest above the inputs (hidden states, head weight, teacher logits).
    """
    batch_size, length, vocab = shape
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn((batch_size, length, hidden_size), device=device, dtype=dtype, generator=generator)
    hidden.requires_grad_(True)
    head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=hidden_size**-0.5, generator=generator)  # unit-variance logits
    teacher = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    input_ids = torch.randint(0, vocab, (batch_size, length), device=device, generator=generator)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    cuda = device.type == "cuda"
    peak, seconds = 0.0, 0.0
    for _ in range(repeats):
        hidden.grad = head.weight.grad = None
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        student = HeadOutput(hidden, head) if fused else SimpleNamespace(logits=head(hidden))
        out = loss(student, SimpleNamespace(logits=teacher), batch)
        out.total.backward()
        if cuda:
            torch.cuda.synchronize(device)
            peak = max(peak, (torch.cuda.max_memory_allocated(device) - before) / GIB)
        seconds = time.perf_counter() - start
        value = out.total.item()
        del student, out
    return {"peak_above_inputs_gib": peak if cuda else None, "seconds": seconds, "loss": value,
            "head_grad_norm": head.weight.grad.float().norm().item()}


def measure_with_head(losses: dict[str, tuple[DistillationLoss, bool]], naive: DistillationLoss,
                      shape: tuple[int, int, int], hidden_size: int, device: torch.device,
                      dtype: torch.dtype, repeats: int = 3) -> dict[str, Any]:
    """Head + loss from hidden states: each of ``losses`` (name -> (loss, fused)) and naive (full logits)."""
    result: dict[str, Any] = {"tokens": shape[0] * shape[1], "batch": shape[0], "length": shape[1],
                              "vocab": shape[2], "hidden": hidden_size, "dtype": str(dtype).removeprefix("torch.")}
    for name, (loss, fused) in (*losses.items(), ("naive", (naive, False))):
        result[name] = _one_with_head(loss, fused, shape, hidden_size, device, dtype, repeats)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    naive_peak = result["naive"]["peak_above_inputs_gib"]
    result["over_naive"] = {name: None if naive_peak is None else result[name]["peak_above_inputs_gib"] / naive_peak
                            for name in losses}
    return result
