"""What a drafter buys on one GPU: the latencies speculative decoding is made of, the speed-up tau predicts, and
speculative decoding run end to end, bounded by a drafter that always agrees and one that never does.

Random-initialised models of the served shapes (``pairs.py``: Qwen2-7B-shaped target, Qwen2-0.5B-shaped drafter,
one vocabulary; latency depends on shapes, not on what the weights learned), SDPA, KV caches:

1. **Latencies** at each ``--batch``, in ``--dtype`` (bf16): the target's decode step (1 token after a
   ``--prompt``-token cache), its verification of ``gamma + 1`` tokens, the drafter's decode step, and the step of
   a feature-reading drafter on the target (EAGLE-3's one layer, ``students/feature_drafter.py``; its step's fused
   input is given, as a server computes ``fc`` once per verified token); median of ``--repeats`` after a warm-up,
   CUDA synchronised. With each tau of ``--tau`` the speed-up ``speculative.predicted_speedup`` gives.
2. **End to end** (batch 1, greedy), in ``--e2e-dtype`` (float32, TF32 off): ``--new`` tokens by the target alone
   (its own cached decode loop) and by speculative decoding with the drafter in the ``--policies``: ``always`` (the
   drafter's forward runs, then its token is replaced by the target's greedy token, known from the target-alone
   run: tau = gamma + 1), ``never`` (replaced by any other token: tau = 1) and ``model`` (the random drafter's own
   argmax). The same cached loop for all (KV caches cropped after each verification), hand-written here because
   transformers' assisted generation offers no drafter that is forced to agree; its tokens are checked equal to the
   target's greedy tokens in every policy.

Why float32 end to end: a random target's logits are nearly flat (their top two are often within bf16's rounding,
or tied once rounded), and the verification of ``gamma + 1`` tokens runs other kernels than a one-token step, so in
bf16 it picks another token now and then; one such flip sends the rest of the text elsewhere, and the ``always``
drafter, fed the target-alone tokens, is rejected from there on (the 2026-12-03 run: tau 1.07, not 5). ``agreement``
measures it on the run: the share of the target-alone greedy tokens that one uncached forward over the text also
picks, and the smallest gap between the top two logits, in each dtype (on the CPU: ``drafting_ties.py``).

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

from distill_kit.students.feature_drafter import FeatureDrafter  # noqa: E402
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


@torch.no_grad()
def agreement(target, prompt: torch.Tensor, reference: list[int]) -> dict[str, float]:
    """How far the target's greedy tokens hold under other kernels: the share of ``reference`` (its cached one-token
    steps) that one uncached forward over prompt + reference also picks, and the smallest gap between the top two
    logits of that forward (0: a tie)."""
    ids = torch.cat([prompt, prompt.new_tensor(reference[:-1])])[None]
    logits = target(input_ids=ids).logits[0, len(prompt) - 1:].float()
    top = logits.topk(2, dim=-1).values
    picked = logits.argmax(-1).cpu() == torch.tensor(reference)
    return {"agree": picked.float().mean().item(), "first_disagreement": int((~picked).nonzero()[0]) if (
        ~picked).any() else None, "min_top2_gap": (top[:, 0] - top[:, 1]).min().item()}


@torch.no_grad()
def feature_latency(drafter, batch: int, prompt: int, repeats: int, device: torch.device) -> float:
    """Seconds of the feature-reading drafter's decode step at ``batch`` rows after ``prompt`` cached tokens."""
    ids = torch.randint(0, drafter.config.vocab_size, (batch, prompt), device=device)
    return speculative.feature_step_latency(drafter, ids, repeats)


def save(result: dict, out: str) -> None:
    """Written after every phase: a run stopped by its time limit keeps what it measured."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "bench_drafting.json").write_text(json.dumps(result, indent=2))


def build(config, dtype: torch.dtype, device: torch.device):
    config = config.__class__.from_dict(config.to_dict() | {"use_cache": True})
    with device:  # built on the device: a 7.6B model is never initialised on the host
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="qwen2-7b-0.5b", choices=sorted(PAIRS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="of the latencies")
    parser.add_argument("--e2e-dtype", default="fp32", choices=["bf16", "fp32"],
                        help="of the end-to-end runs (float32: no near-ties flipped by kernels, module docstring)")
    parser.add_argument("--policies", nargs="+", default=["never", "always"], choices=["never", "model", "always"])
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
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    dtype, e2e_dtype = dtypes[args.dtype], dtypes[args.e2e_dtype]
    if device.type == "cuda":  # float32 means float32: TF32 matmuls would round as coarsely as the ties they avoid
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    pair = PAIRS[args.pair]
    result: dict = {"pair": args.pair, "description": pair.description, "settings": vars(args),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "latency": {}, "agreement": {}, "end_to_end": {}}
    torch.manual_seed(0)
    target, drafter = build(pair.teacher, dtype, device), build(pair.student, dtype, device)
    feature = FeatureDrafter(target).eval()
    for batch in args.batch:
        figures = {"target_step_s": latency(target, batch, args.prompt, 1, args.repeats, device),
                   "target_verify_s": latency(target, batch, args.prompt, args.gamma + 1, args.repeats, device),
                   "drafter_step_s": latency(drafter, batch, args.prompt, 1, args.repeats, device),
                   "feature_drafter_step_s": feature_latency(feature, batch, args.prompt, args.repeats, device)}
        figures["predicted_speedup"] = {str(tau): speculative.predicted_speedup(tau, args.gamma, figures)
                                        for tau in args.tau}
        figures["feature_drafter_predicted_speedup"] = {
            str(tau): speculative.predicted_speedup(tau, args.gamma, figures | {
                "drafter_step_s": figures["feature_drafter_step_s"]}) for tau in args.tau}
        result["latency"][str(batch)] = figures
        print(f"batch {batch}: " + json.dumps(figures), flush=True)
        save(result, args.out)
    prompt = torch.randint(0, pair.teacher.vocab_size, (args.prompt,), device=device)
    reference, _ = target_alone(target, prompt, args.new)
    result["agreement"][args.dtype] = agreement(target, prompt, reference)
    print(f"agreement {args.dtype}: " + json.dumps(result["agreement"][args.dtype]), flush=True)
    if e2e_dtype != dtype:
        del feature
        target, drafter = target.to(e2e_dtype), drafter.to(e2e_dtype)
    target_alone(target, prompt, 4)  # warm-up
    reference, seconds = target_alone(target, prompt, args.new)
    result["agreement"][args.e2e_dtype] = agreement(target, prompt, reference)
    print(f"agreement {args.e2e_dtype}: " + json.dumps(result["agreement"][args.e2e_dtype]), flush=True)
    result["end_to_end"]["dtype"] = args.e2e_dtype
    result["end_to_end"]["target_alone"] = {"tokens_per_s": args.new / seconds, "seconds": seconds}
    for policy in args.policies:
        speculative_run(target, drafter, prompt, 4, args.gamma, policy, reference)  # warm-up
        tokens, accepted, seconds = speculative_run(target, drafter, prompt, args.new, args.gamma, policy, reference)
        result["end_to_end"][policy] = {
            "tokens_per_s": args.new / seconds, "seconds": seconds,
            "speedup_vs_target": result["end_to_end"]["target_alone"]["seconds"] / seconds,
            "tau": (sum(accepted) + len(accepted)) / len(accepted), "rounds": len(accepted),
            "same_tokens_as_target": tokens == reference}
        print(f"{policy}: " + json.dumps(result["end_to_end"][policy]), flush=True)
        save(result, args.out)
    save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
