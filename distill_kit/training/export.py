"""Write a trained student as a Hugging Face model directory that ``from_pretrained`` loads anywhere.

Under ZeRO-3 each rank holds a slice of every weight, and ``save_pretrained`` on a rank would write
slices (or empty tensors). The weights are gathered first (all ranks take part), and rank 0 writes.
Under ZeRO-0/1/2 the weights are already whole on every rank and the gather is a no-op.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
from torch import nn

from distill_kit.engines import distributed, peft_student, quantize
from distill_kit.engines.models import active_transformers_config


def export_student(model: nn.Module, directory: str | Path, tokenizer: Any | None = None,
                   merged: bool = False) -> Path:
    """Save ``model`` (the bare student, without loss parameters) and its tokenizer to ``directory``.

    A PEFT student (stage 0-2: whole on every rank) is written as its adapter folder, and with ``merged`` also
    as the merged model in ``directory/merged`` (``engines/peft_student.py``). A quantized student is converted to
    its real low-bit weights and written with its ``quantization_config`` (``engines/quantize.py``).
    """
    directory = Path(directory)
    if (scheme := quantize.quantize_of(model)) is not None:  # ZeRO 0-2 (the plan's rule): whole on every rank
        if distributed.is_main():
            quantize.save(model, scheme, directory, tokenizer)
        distributed.barrier()
        return directory
    if peft_student.is_peft(model):
        if distributed.is_main():
            peft_student.export(model, directory, tokenizer, merged)
        distributed.barrier()
        return directory
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if distributed.is_main():
            state = {name: tensor.detach().clone().cpu() for name, tensor in model.state_dict().items()}
            # No DeepSpeed config may be active: transformers would then save the (partitioned) parameters.
            with active_transformers_config(None):
                model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
    distributed.barrier()
    return directory
