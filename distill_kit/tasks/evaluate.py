"""Greedy answers to held-out prompts, scored by the task's exact checker (the ``exact_match`` metric module)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from distill_kit.tasks import arithmetic


@torch.no_grad()
def generate_answers(model: nn.Module, tokenizer, items: Sequence[arithmetic.Example], max_new_tokens: int = 32,
                     batch_size: int = 250) -> list[str]:
    """The model's greedy completion of each prompt (any task's items: a ``prompt`` string), decoded up to its end
    token."""
    was_training = model.training
    model.eval()
    answers = []
    try:
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            prompts = [arithmetic.encode(tokenizer, item, with_answer=False)[0] for item in chunk]
            length = max(map(len, prompts))
            ids = torch.tensor([[tokenizer.pad_token_id] * (length - len(p)) + p for p in prompts])
            mask = (torch.arange(length)[None] >= torch.tensor([length - len(p) for p in prompts])[:, None]).long()
            device = next(model.parameters()).device
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            answers += tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return answers


def checked_answers(model: nn.Module, tokenizer, items: Sequence[arithmetic.Example], max_new_tokens: int = 32,
                    check: Callable[[str, str], bool] = arithmetic.check) -> list[dict[str, Any]]:
    """Each prompt's greedy answer and the task checker's verdict on it (``check(prompt, answer)``), in the items'
    order: ``{"doc_id", "prompt", "response", "exact_match"}``, as the harness's samples name them
    (``tasks/harness``)."""
    answers = generate_answers(model, tokenizer, items, max_new_tokens)
    return [{"doc_id": i, "prompt": item.prompt, "response": answer, "exact_match": check(item.prompt, answer)}
            for i, (item, answer) in enumerate(zip(items, answers, strict=True))]


def accuracy(checked: Sequence[dict[str, Any]]) -> float:
    """The ``exact_match`` metric of :func:`checked_answers`' verdicts: the share the checker accepts."""
    from distill_kit.training.evaluation import load_metric

    return load_metric("exact_match").compute(predictions=[row["exact_match"] for row in checked],
                                              references=[True] * len(checked))["exact_match"]


def exact_match(model: nn.Module, tokenizer, items: Sequence[arithmetic.Example], max_new_tokens: int = 32,
                check: Callable[[str, str], bool] = arithmetic.check) -> float:
    """Share of prompts whose greedy answer the task's checker accepts (``check(prompt, answer)``; items of another
    task, e.g. ``sorting``, with its ``check``)."""
    return accuracy(checked_answers(model, tokenizer, items, max_new_tokens, check))
