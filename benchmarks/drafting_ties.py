"""Why a random-weight target's cached greedy tokens are not what its verification forward picks in bf16.

A random-initialised Qwen2 of the 0.5B width and vocabulary (896 wide, 151,936 tokens; ``--layers`` of its 24
layers), seeded: its greedy tokens by its own cached one-token decode loop, then one uncached forward over the
prompt and those tokens (other kernels, as a verification of several tokens runs). Printed for float32 and bf16
(the same weights): the share of the greedy tokens that forward also picks, the smallest gap between the top two
logits, and the largest difference between a step's logits and the forward's at the same position. Random weights
give nearly flat logits, whose top two sit within bf16's rounding (or tie once rounded): one flipped token sends
the rest of a speculative-decoding run elsewhere (benchmarks/bench_drafting.py, results/drafters.md)::

    OMP_NUM_THREADS=1 python benchmarks/drafting_ties.py          # CPU, about a minute
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from pairs import QWEN2_VOCAB, qwen2  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


@torch.no_grad()
def ties(model, prompt: torch.Tensor, new: int) -> dict[str, float]:
    out = model(input_ids=prompt, use_cache=True)
    cache, tokens, steps = out.past_key_values, [int(out.logits[0, -1].argmax())], [out.logits[0, -1].float()]
    while len(tokens) < new:
        out = model(input_ids=prompt.new_tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
        steps.append(out.logits[0, -1].float())
    whole = model(input_ids=torch.cat([prompt, prompt.new_tensor([tokens[:-1]])], dim=1)).logits[0]
    whole = whole[prompt.shape[1] - 1:].float()
    steps = torch.stack(steps)
    top = steps.topk(2, dim=-1).values
    return {"agree": (whole.argmax(-1) == torch.tensor(tokens)).float().mean().item(),
            "min_top2_gap": (top[:, 0] - top[:, 1]).min().item(),
            "median_top2_gap": (top[:, 0] - top[:, 1]).median().item(),
            "logit_std": steps.std().item(), "max_step_vs_forward": (steps - whole).abs().max().item()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=40)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = qwen2(896, 4864, args.layers, 14, 2, QWEN2_VOCAB, tied=False)
    config.use_cache = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompt = torch.randint(0, QWEN2_VOCAB, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        print(name, json.dumps(ties(model.to(dtype), prompt, args.new)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
