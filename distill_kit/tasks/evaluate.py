"""Greedy answers to held-out prompts, scored by the task's exact checker (the ``exact_match`` metric module)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def exact_match(model: nn.Module, tokenizer, items: Sequence[arithmetic.Example], max_new_tokens: int = 32,
                check: Callable[[str, str], bool] = arithmetic.check) -> float:
    """Share of prompts whose greedy answer the task's checker accepts (``check(prompt, answer)``; items of another
    task, e.g. ``sorting``, with its ``check``)."""
    from distill_kit.training.evaluation import load_metric

    answers = generate_answers(model, tokenizer, items, max_new_tokens)
    metric = load_metric("exact_match")
    return metric.compute(predictions=[check(i.prompt, a) for i, a in zip(items, answers, strict=True)],
                          references=[True] * len(items))["exact_match"]
