"""A teacher that reads its outputs from a store instead of computing them: offline distillation.

:class:`CapturedTeacher` is an ``nn.Module`` with the teacher's config and no weights, whose forward
returns what the real teacher returned for the same sequence when it was captured
(``distill_kit/offline/capture.py``). So it goes where a teacher goes, and nothing else changes::

    teacher = CapturedTeacher("stores/qwen7b-k64", tokenizer=tokenizer, dataset=blocks, k=64)
    distiller = Distiller("path/to/student", teacher, loss="forward_kl")
    distiller.train(loader)           # the same step, the same losses; no teacher engine, no teacher weights

The Distiller reads the teacher's width, depth and vocabulary from ``config`` as it would from a model
(ZeRO sizes, hidden-state layer maps, the vocabulary check); ``engines.build_teacher`` leaves a teacher
without weights as it is. The output's ``logits`` are :class:`losses.sparse.SparseTeacherLogits`, which
the logit losses compare on the captured top k; ``hidden_states`` hold the captured layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from distill_kit.offline.fingerprints import dataset_fingerprint, tokenizer_fingerprint
from distill_kit.offline.store import StoreReader, StoreSpec, block_key
from losses.sparse import SampledTeacherLogits, SparseTeacherLogits


class StoreMismatchError(ValueError):
    """A store captured from other inputs than this run's; the message names every difference."""


def check_store(spec: StoreSpec, root: Path, *, tokenizer: Any = None, dataset: datasets.Dataset | str | None = None,
                k: int | None = None) -> None:
    """Refuse a store made with another tokenizer, dataset or k; each given value is compared, all at once."""
    problems = []
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != spec.tokenizer_hash:
        problems.append(
            f"tokenizer: the store's is {spec.tokenizer!r} (vocabulary sha256 {spec.tokenizer_hash[:12]}), this "
            f"run's is {getattr(tokenizer, 'name_or_path', '?')!r} ({tokenizer_fingerprint(tokenizer)[:12]})"
        )
    if dataset is not None:
        fingerprint = dataset if isinstance(dataset, str) else dataset_fingerprint(dataset)
        if fingerprint != spec.dataset:
            problems.append(f"dataset: the store's blocks are {spec.dataset}, this run's are {fingerprint} "
                            "(sha256 of the block hashes : number of blocks)")
    if k is not None and k != spec.k:
        problems.append(f"k: the store holds the top {spec.k} tokens per position, this run asks for {k}")
    if problems:
        raise StoreMismatchError(
            f"the teacher store {root} does not fit this run:\n  - " + "\n  - ".join(problems)
            + "\nCapture a store for this run with scripts/capture_teacher.py, or point at one that matches."
        )


@dataclass
class CapturedOutput:
    """What a captured teacher returns: the fields of a causal LM output the losses read."""

    logits: SparseTeacherLogits
    hidden_states: CapturedHiddenStates | None = None


class CapturedHiddenStates(Sequence[torch.Tensor]):
    """The ``hidden_states`` tuple of a model with ``num_layers`` layers, of which only some were captured.

    Indexed like Hugging Face's tuple (0 = embeddings, ``num_layers`` = last), so a hidden-state loss's
    layer map works unchanged; asking for a layer not captured names the ones that were.
    """

    def __init__(self, states: Mapping[int, torch.Tensor], num_layers: int):
        self.states, self.num_layers = dict(states), num_layers

    def __len__(self) -> int:
        return self.num_layers + 1

    def __getitem__(self, layer: int) -> torch.Tensor:  # type: ignore[override]
        layer = layer + len(self) if layer < 0 else layer
        if layer not in self.states:
            raise KeyError(
                f"teacher hidden layer {layer} was not captured; the store holds layers {sorted(self.states)}. "
                "Capture again with --hidden-layers including it, or change the loss's 'layers'."
            )
        return self.states[layer]


class CapturedTeacher(nn.Module):
    """The teacher's outputs, looked up by sequence in a store; a frozen "model" with no parameters.

    Args:
        store: a folder written by ``scripts/capture_teacher.py``.
        tokenizer, dataset, k: this run's, to be checked against the store's (each is optional; give them:
            a mismatch otherwise shows only when a sequence is not found). ``dataset`` is the tokenised
            block dataset, or its :func:`~distill_kit.offline.fingerprints.dataset_fingerprint`.
        tail_bucket: compare on k + 1 outcomes, the top k and the rest (exact at temperature 1 only), or,
            if False, on the top k renormalised (any temperature). See ``losses/sparse.py``.
    """

    def __init__(self, store: str | Path, *, tokenizer: Any = None, dataset: datasets.Dataset | str | None = None,
                 k: int | None = None, tail_bucket: bool = True):
        super().__init__()
        self.reader = StoreReader(store)
        self.spec = self.reader.spec
        check_store(self.spec, self.reader.root, tokenizer=tokenizer, dataset=dataset, k=k)
        self.config = teacher_config(self.spec)
        self.tail_bucket = tail_bucket
        self.teacher_sha256 = self.spec.teacher_hash  # the identity checkpoints record (checkpoint.py)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_hidden_states: bool = False, output_attentions: bool = False, **_: Any) -> CapturedOutput:
        if output_attentions:
            raise ValueError("a captured teacher has no attention maps; distil attention from the live teacher")
        if output_hidden_states and not self.spec.hidden_layers:
            raise ValueError("the teacher store holds no hidden states; capture again with --hidden-layers")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        rows = [self.reader.rows(block_key(ids, keep)) for ids, keep in zip(input_ids, mask, strict=True)]
        positions = mask.cpu()

        def assemble(name: str) -> torch.Tensor:
            """(B, T, ...) from each block's rows, placed at its real tokens; padding positions hold zeros."""
            first = rows[0][name]
            out = first.new_zeros((*positions.shape, *first.shape[1:]))
            for block, block_rows in enumerate(rows):
                out[block, positions[block]] = block_rows[name]
            return out.to(input_ids.device, non_blocking=True)

        if self.spec.targets == "sampled":
            logits = SampledTeacherLogits(assemble("log_probs"), assemble("ids"), assemble("counts"),
                                          self.spec.temperature)
        else:
            logits = SparseTeacherLogits(assemble("log_probs"), assemble("ids"),
                                         assemble("log_tail") if self.tail_bucket else None)
        hidden = None
        if output_hidden_states:
            hidden = CapturedHiddenStates({layer: assemble(f"hidden.{layer}") for layer in self.spec.hidden_layers},
                                          self.config.get_text_config().num_hidden_layers)
        return CapturedOutput(logits, hidden)


def teacher_config(spec: StoreSpec) -> PretrainedConfig:
    """The captured teacher's own config class, rebuilt from the manifest."""
    values = dict(spec.teacher_config)
    return AutoConfig.for_model(values.pop("model_type"), **values)
