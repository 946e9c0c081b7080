"""What a drafter buys on one GPU: the latencies speculative decoding is made of, the speed-up tau predicts, and
speculative decoding run end to end, bounded by a drafter that always agrees and one that never does.

Random-initialised models of the served shapes (``pairs.py``: Qwen2-7B-shaped target, Qwen2-0.5B-shaped drafter,
one vocabulary; latency depends on shapes, not on what the weights learned), bf16, SDPA, KV caches:

1. **Latencies** at each ``--batch``: the target's decode step (1 token after a ``--prompt``-token cache), its
   verification of ``gamma + 1`` tokens, the drafter's decode step (median of ``--repeats`` after a warm-up, CUDA
   synchronised). With each tau of ``--tau`` (the CPU runs' figures: benchmarks/results/drafters.md) the speed-up
   ``speculative.predicted_speedup`` gives.
2. **End to end** (batch 1, greedy): ``--new`` tokens by the target alone (its own cached decode loop) and by
   speculative decoding with the drafter in three policies: ``model`` (the drafter's own argmax: a random drafter,
   about never right), ``always`` (the drafter's forward runs, then its token is replaced by the target's greedy
   token, known from the target-alone run: tau = gamma + 1) and ``never`` (replaced by any other token: tau = 1).
   The same cached loop for all three (KV caches cropped after each verification), hand-written here because
   transformers' assisted generation offers no drafter that is forced to agree; its tokens are checked equal to the
   target's greedy tokens in every policy.

    python benchmarks/bench_drafting.py --out $OUT                          # one H200, about 2 minutes
    python benchmarks/bench_drafting.py --pair tiny --device cpu --new 16   # CPU: test_bench_drafting_smoke.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pairs import PAIRS  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from distill_kit.training import speculative  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, repeats: int, device: torch.device) -> float:
    step()
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@torch.no_grad()
def latency(model, batch: int, prompt: int, new: int, repeats: int, device: torch.device) -> float:
    """Seconds of a forward of ``new`` tokens per row after ``prompt`` cached tokens, at ``batch`` rows."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), device=device)
    cache = model(input_ids=ids, use_cache=True).past_key_values
    step_ids = torch.randint(0, vocab, (batch, new), device=device)

    def step() -> None:
        model(input_ids=step_ids, past_key_values=cache, use_cache=True)
        cache.crop(-new)

    return timed(step, repeats, device)


@torch.no_grad()
def target_alone(target, prompt: torch.Tensor, new: int) -> tuple[list[int], float]:
    """Greedy tokens of the target's own cached decode loop, and its seconds."""
    device = prompt.device
    sync(device)
    started = time.perf_counter()
    out = target(input_ids=prompt[None], use_cache=True)
    cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
    while len(tokens) < new:
        out = target(input_ids=prompt.new_tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    sync(device)
    return tokens, time.perf_counter() - started


@torch.no_grad()
def speculative_run(target, drafter, prompt: torch.Tensor, new: int, gamma: int, policy: str,
                    reference: list[int]) -> tuple[list[int], list[int], float]:
    """Greedy speculative decoding with KV caches (batch 1): (tokens, drafts kept each round, seconds).

    Both caches hold every token but the pending ones: the target's the text up to its last kept token, whose next
    token (the round's correction or bonus) it has not read yet; the drafter's the same, or one fewer after a round
    that kept every draft (its last draft was never fed to it). ``policy`` ``always``/``never`` replace each draft
    by the target's greedy token (``reference``) or by another token, after the drafter's forward has run."""
    device = prompt.device
    vocab = target.config.vocab_size
    sync(device)
    started = time.perf_counter()
    out = target(input_ids=prompt[None, :-1], use_cache=True)
    t_cache = out.past_key_values
    d_cache = drafter(input_ids=prompt[None, :-1], use_cache=True).past_key_values
    tokens: list[int] = []
    accepted: list[int] = []
    t_pending = d_pending = [int(prompt[-1])]
    while len(tokens) < new:
        drafts, feed = [], d_pending
        for i in range(gamma):
            logits = drafter(input_ids=prompt.new_tensor([feed]), past_key_values=d_cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            if policy != "model":
                truth = reference[min(len(tokens) + i, len(reference) - 1)]
                token = truth if policy == "always" else (truth + 1) % vocab
            drafts.append(token)
            feed = [token]
        verify = target(input_ids=prompt.new_tensor([t_pending[-1:] + drafts]), past_key_values=t_cache,
                        use_cache=True).logits[0].argmax(-1).tolist()
        kept = 0
        while kept < gamma and drafts[kept] == verify[kept]:
            kept += 1
        accepted.append(kept)
        following = verify[kept]
        tokens += drafts[:kept] + [following]
        t_cache.crop(-(gamma - kept))  # it read pending + gamma drafts; keep pending + the kept drafts
        if kept < gamma:
            d_cache.crop(-(gamma - 1 - kept))  # it read pending + gamma - 1 drafts
            d_pending = [following]
        else:
            d_pending = [drafts[-1], following]
        t_pending = [following]
    sync(device)
    return tokens[:new], accepted, time.perf_counter() - started


def build(config, dtype: torch.dtype, device: torch.device):
    config = config.__class__.from_dict(config.to_dict() | {"use_cache": True})
    with device:  # built on the device: a 7.6B model is never initialised on the host
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="qwen2-7b-0.5b", choices=sorted(PAIRS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tau", type=float, nargs="*", default=[1.236, 1.366, 1.469, 1.77, 2.5, 5.0],
                        help="taus to predict a speed-up from (defaults: the CPU grid's total variation, no-teacher "
                             "and forward-KL drafters, benchmarks/results/drafters.md; the issue's make-distill "
                             "student and target; gamma + 1)")
    parser.add_argument("--out", default="runs/bench_drafting")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    pair = PAIRS[args.pair]
    target, drafter = build(pair.teacher, dtype, device), build(pair.student, dtype, device)
    result: dict = {"pair": args.pair, "description": pair.description, "settings": vars(args),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "latency": {}, "end_to_end": {}}
    for batch in args.batch:
        figures = {"target_step_s": latency(target, batch, args.prompt, 1, args.repeats, device),
                   "target_verify_s": latency(target, batch, args.prompt, args.gamma + 1, args.repeats, device),
                   "drafter_step_s": latency(drafter, batch, args.prompt, 1, args.repeats, device)}
        figures["predicted_speedup"] = {str(tau): speculative.predicted_speedup(tau, args.gamma, figures)
                                        for tau in args.tau}
        result["latency"][str(batch)] = figures
        print(f"batch {batch}: " + json.dumps(figures), flush=True)
    prompt = torch.randint(0, pair.teacher.vocab_size, (args.prompt,), device=device)
    target_alone(target, prompt, 4)  # warm-up
    reference, seconds = target_alone(target, prompt, args.new)
    result["end_to_end"]["target_alone"] = {"tokens_per_s": args.new / seconds, "seconds": seconds}
    for policy in ("never", "model", "always"):
        speculative_run(target, drafter, prompt, 4, args.gamma, policy, reference)  # warm-up
        tokens, accepted, seconds = speculative_run(target, drafter, prompt, args.new, args.gamma, policy, reference)
        result["end_to_end"][policy] = {
            "tokens_per_s": args.new / seconds, "seconds": seconds,
            "speedup_vs_target": result["end_to_end"]["target_alone"]["seconds"] / seconds,
            "tau": (sum(accepted) + len(accepted)) / len(accepted), "rounds": len(accepted),
            "same_tokens_as_target": tokens == reference}
        print(f"{policy}: " + json.dumps(result["end_to_end"][policy]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_drafting.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
