"""A served teacher's output head, read from the teacher's own folder: the one tensor (and bias) the loss applies.

A served teacher that sends its final hidden states (``payload: hidden``) needs its head on the training side. It
comes from the server once (``GET /v1/head``) or, with ``options.head``, from the teacher's ``save_pretrained``
folder: only the head's tensors are read from its safetensors (memory-mapped, one tensor; a tied head is the input
embedding's), never the rest of the weights. Either way its sha256 (``served_protocol.head_digest``, in the dtype the
server computes in) must equal the server's ``head_sha256``, so the loss applies exactly the head the server's
hidden states were made for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distill_kit.errors import ConfigError


def head_names(folder: str | Path) -> tuple[str, str | None]:
    """The checkpoint names of the head's weight and bias (None: no bias) of the model in ``folder``, found by
    building it on the meta device (no memory, no weights read): a tied head is named by its embedding."""
    from transformers import AutoModelForCausalLM

    from distill_kit.engines.models import model_config

    config = model_config(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigError(f"{folder}: the model has no output head to apply")
    names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
    # named_parameters lists a tied weight first under the module that owns it (the embedding): the checkpoint's name
    weight = next(name for name, param in model.named_parameters() if param is head.weight)
    bias = getattr(head, "bias", None)
    return weight, None if bias is None else names[id(bias)]


def _files(folder: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (one file, or a sharded checkpoint's index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"{folder}: no model.safetensors (or its index): the head is read from a safetensors "
                          "checkpoint (pickled .bin files are never loaded); give the folder save_pretrained wrote, or "
                          "leave options.head out to take the head from the server")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def load_head(folder: str | Path, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight (V, H) and bias (V,) or None from ``folder``, cast to ``dtype`` (the server's)."""
    from safetensors import safe_open

    folder = Path(folder)
    files = _files(folder)
    tensors = []
    for name in head_names(folder):
        if name is None:
            tensors.append(None)
            continue
        # a tied head saved under the head's name only, or a checkpoint whose names carry no "model." prefix
        found = next((n for n in (name, "lm_head.weight" if name.endswith("embed_tokens.weight") else None,
                                  name.removeprefix("model.")) if n in files), None)
        if found is None:
            raise ConfigError(f"{folder}: the checkpoint holds no {name!r}, the head's tensor")
        with safe_open(files[found], framework="pt") as handle:
            tensors.append(handle.get_tensor(found).to(dtype))
    return tensors[0], tensors[1]
