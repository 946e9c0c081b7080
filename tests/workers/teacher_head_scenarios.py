"""A ZeRO-3 teacher run without its head (``engines/head.py:teacher_head_forward``) on one CPU rank, against the
same weights run whole; launched by tests/test_teacher_head.py. Writes ``<out>/teacher_head.rank0.json``.

Both a Qwen2 (untied head, partitioned on its own) and a Llama (head tied to the input embedding) are checked; the
persistence threshold is 0 so that ZeRO-3 partitions even these tiny heads, as it does a real vocabulary's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_results import write  # noqa: E402
from tiny_models import llama_config, qwen2_config, random_batches  # noqa: E402

from distill_kit.engines import distributed  # noqa: E402
from distill_kit.engines.build import build_teacher  # noqa: E402
from distill_kit.engines.head import GatheredHead, teacher_head_forward  # noqa: E402
from losses import build_loss  # noqa: E402

ZERO3 = {"train_micro_batch_size_per_gpu": 2,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def scenario(config) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full_weight = model.get_output_embeddings().weight.detach().clone()
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # the same weights, never partitioned
    reference.load_state_dict(model.state_dict())
    engine = build_teacher(model, ZERO3, "fp32", torch.device("cpu"))
    head = engine.module.get_output_embeddings()
    result = {"partitioned_before": head.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE}
    loss = build_loss({"name": "forward_kl", "temperature": 2.0, "chunk_size": 5})
    diffs = {"weight": 0.0, "hidden": 0.0, "logits": 0.0, "loss": 0.0, "full_forward": 0.0}
    batches = random_batches(3, 2, 12, seed=5)
    with torch.no_grad():
        for step, batch in enumerate(batches):  # several steps: the coordinator's trace must hold across them
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            out = teacher_head_forward(engine, **inputs)
            result["gathered_head"] = isinstance(out.head, GatheredHead)
            result["partitioned_after"] = head.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
            plain = reference(**inputs, output_hidden_states=True)
            diffs["weight"] = max(diffs["weight"], (out.head.weight - full_weight).abs().max().item())
            diffs["hidden"] = max(diffs["hidden"], (out.hidden - plain.hidden_states[-1]).abs().max().item())
            student = torch.randn(*plain.logits.shape, generator=torch.Generator().manual_seed(step))
            student = type("Student", (), {"logits": student})()
            headless = loss(student, out, batch).total
            assert out._logits is None  # the loss applied the head per chunk
            dense = loss(student, plain, batch).total
            diffs["loss"] = max(diffs["loss"], abs(headless.item() - dense.item()) / dense.item())
            diffs["logits"] = max(diffs["logits"], (out.logits - plain.logits).abs().max().item())
            if step == 1:
                # The second forward completed the trace the first recorded: ZeRO-3's start-of-forward hook ran
                # (with the body called alone it does not, no trace is ever recorded, and nothing is prefetched).
                result["trace_complete"] = engine.optimizer.get_param_coordinator().is_complete_trace()
                # A whole forward between headless ones (evaluation does that) still works.
                diffs["full_forward"] = (engine(**inputs).logits - plain.logits).abs().max().item()
    engine.destroy()
    return result | {f"max_diff_{name}": value for name, value in diffs.items()}


def main(out: Path) -> None:
    distributed.init()
    overrides = {"attn_implementation": "eager"}
    write(out, "teacher_head", {"qwen2": scenario(qwen2_config(**overrides)),
                                "llama_tied": scenario(llama_config(**overrides))})
    distributed.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
