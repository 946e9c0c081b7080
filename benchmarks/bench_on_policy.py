"""On-policy distillation speed: the student's generation, and a whole on-policy step against an off-policy one.

Two measurements, on random-initialised models (speed depends on shapes, not weights; see ``pairs.py``):

* ``generate``: new tokens/s per GPU of the student's sampler (``training/on_policy.py``: HF ``generate`` on the
  bare model), ``--prompt-len`` prompt tokens and ``--new-tokens`` sampled tokens per row (a random model almost
  never samples its end token, so every row runs to the end), for each ``--gen-cache`` variant at each
  ``--gen-batch``;
* ``step``: the Distiller with its ZeRO-2 student and ZeRO-3 teacher on rows of ``prompt + answer``, one run per
  ``--runs`` entry ``mode/micro_batch/gradient_accumulation/generation_batch_size[/samples_per_prompt]``: mode
  ``off`` (the data's answers), ``on`` (fraction 1: the student samples every answer, the teacher scores them,
  forward KL), ``opd`` (the same samples, ``policy_gradient`` with the teacher's advantage only) or ``opd_reward``
  (the same with a reward: ``training.rewards`` scores every sample, decoded by a word-level tokenizer of the
  student's vocabulary, and its group advantage joins the teacher's); the runs share one teacher engine. Reported
  per GPU: trained tokens/s (answer tokens the loss counts, and all tokens forwarded), the share of the step spent
  making its batches (sampling, and scoring with rewards) and, with rewards, the share spent in the rewards.

Results go to ``<out>/<name>.json``, rewritten after each measurement (a run cut short keeps what it measured).

GPU (one H200, as recorded in benchmarks/RESULTS.md; ``torchrun --nproc_per_node N`` on N GPUs)::

    python benchmarks/bench_on_policy.py --pair qwen2-7b-0.5b --gen-batch 256 384 512 \
        --gen-cache static static-repeat-kv static-eager --out runs/on_policy --name gen --skip step
    python benchmarks/bench_on_policy.py --pair qwen2-7b-0.5b --skip generate \
        --runs off/16/1/0 on/16/1/0 off/16/4/0 on/16/4/64 --warmup 1 --steps 3 --out runs/on_policy --name step
    python benchmarks/bench_on_policy.py --pair qwen2-7b-0.5b --skip generate \
        --runs opd/64/1/0/8 opd_reward/64/1/0/8 --warmup 1 --steps 3 --out runs/on_policy --name rewards

CPU smoke::

    python benchmarks/bench_on_policy.py --pair tiny --prompt-len 8 --new-tokens 8 --gen-batch 2 3 \
        --gen-cache static dynamic static-eager --runs off/2/1/0 on/2/1/0 on/2/2/3 opd/4/1/0/2 opd_reward/4/1/0/2 \
        --warmup 1 --steps 1 --dtype fp32 --out /tmp/bench_on_policy
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pairs
import torch
import transformers

from distill_kit import Distiller, TrainingConfig
from distill_kit.config import CONFIG_DIR, RewardsConfig, RewardSpec
from distill_kit.engines import deepspeed_config, distributed
from distill_kit.rewards import register
from distill_kit.training.on_policy import OnPolicyConfig, Sampler
from distill_kit.training.plan import DataFacts

MODES = {"off": "forward_kl", "on": "forward_kl", "opd": {"name": "policy_gradient", "teacher": 1.0, "reward": 0.0},
         "opd_reward": {"name": "policy_gradient", "teacher": 1.0, "reward": 1.0}}
"""Each run's loss by mode; every mode but ``off`` samples every answer."""


@register("bench_digits")
def bench_digits(prompt: str, completion: str) -> float:
    """The reward of the opd_reward runs: a text check of the cost of a task checker (the share of the sample's
    words that end in an even digit; a random student's samples vary in it)."""
    words = completion.split()
    return sum(word[-1:] in "02468" for word in words) / max(len(words), 1)


def word_tokenizer(vocab_size: int, directory: Path) -> str:
    """A word-level tokenizer of ``vocab_size`` words ``w0 w1 ...`` saved to ``directory``: what the rewards decode
    samples with (the benchmark's models are random and ship no tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(directory)
    return str(directory)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(batch: int, length: int, vocab: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, vocab, (batch, length), generator=generator).to(device))


def measure_generation(args, device: torch.device, record) -> list[dict]:
    """New tokens/s of the student's sampler at each batch and cache (the first call warms up: it compiles the
    static cache's decode step, which transformers does for each new batch size). ``static-repeat-kv`` is the
    static cache without ``on_policy.sdpa_gqa`` (each key/value head repeated per query head, transformers' default
    under compilation); ``static-eager`` the static cache with transformers' automatic compilation off
    (``generation_config.disable_compile``)."""
    pair = pairs.PAIRS[args.pair]
    model = pairs.build(pair.student, {}, args.dtype, device, "sdpa").eval()
    results = []
    for batch in args.gen_batch:
        for variant in args.gen_cache:
            config = OnPolicyConfig(fraction=1.0, max_new_tokens=args.new_tokens, temperature=1.0,
                                    cache="dynamic" if variant == "dynamic" else "static",
                                    sdpa_gqa=variant != "static-repeat-kv",
                                    eos_token_id=pair.student.vocab_size - 1, pad_token_id=0)
            model.generation_config.disable_compile = variant == "static-eager"
            sampler = Sampler(config, lambda: model)
            rows = prompts(batch, args.prompt_len, pair.student.vocab_size, args.seed, device)
            sync(device)
            started = time.perf_counter()
            sampler.generate(rows)  # warm-up (and compilation, for the static cache)
            sync(device)
            warmup = time.perf_counter() - started
            timings = []
            for _ in range(args.gen_repeats):
                started = time.perf_counter()
                samples = sampler.generate(rows)
                sync(device)
                timings.append(time.perf_counter() - started)
            seconds = min(timings)
            new = sum(len(s) for s in samples)
            results.append({"batch": batch, "cache": variant, "new_tokens": new, "seconds": seconds,
                            "all_seconds": timings, "warmup_s": warmup, "new_tokens_per_s": new / seconds,
                            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
                            else 0.0})
            print(json.dumps(results[-1]), flush=True)
            record()
    model.generation_config.disable_compile = False
    return results


class Timed(Distiller):
    """The Distiller, with the time spent making the step's batches (the sampling) added up."""

    make_batch_s = 0.0
    reward_s = 0.0

    def make_batches(self, batches):
        sync(self.device)
        started = time.perf_counter()
        made = super().make_batches(batches)
        sync(self.device)
        self.make_batch_s += time.perf_counter() - started
        return made

    def _rewarder(self, tokenizer):
        rewarder = super()._rewarder(tokenizer)
        return None if rewarder is None else lambda batch, where="": self._timed(rewarder, batch, where)

    def _timed(self, rewarder, batch, where):
        started = time.perf_counter()  # the rewards run on the host, on tensors the sampler already synchronised
        out = rewarder(batch, where)
        self.reward_s += time.perf_counter() - started
        return out


def measure_step(args, device: torch.device, run: str, teacher, student) -> tuple[dict, Timed]:
    """One run ``mode/micro_batch/accumulation/generation_batch``: mode ``off`` (the data's answers) or ``on``
    (fraction 1: the student samples every answer). ``teacher`` is an engine from an earlier run, or None;
    ``student`` a fresh student model built before any run (see ``main``)."""
    mode, micro_batch, accumulation, generation_batch, *group = run.split("/")
    micro_batch, accumulation, generation_batch = int(micro_batch), int(accumulation), int(generation_batch)
    group = int(group[0]) if group else 1
    on_policy = mode != "off"
    pair = pairs.PAIRS[args.pair]
    sampling = OnPolicyConfig(fraction=1.0 if on_policy else 0.0, max_new_tokens=args.new_tokens, temperature=1.0,
                              generation_batch_size=generation_batch, samples_per_prompt=group,
                              eos_token_id=pair.student.vocab_size - 1, pad_token_id=0)
    rewards = RewardsConfig(functions=(RewardSpec(name="bench_digits"),) if mode == "opd_reward" else ())
    training = TrainingConfig(max_steps=args.warmup + args.steps, micro_batch_size=micro_batch,
                              gradient_accumulation_steps=accumulation, dtype=args.dtype, lr=1e-5,
                              log_every=10**9, on_policy=sampling, rewards=rewards)
    student_cfg, teacher_cfg = deepspeed_config.prepare_pair(
        CONFIG_DIR / "zero2_student.json", CONFIG_DIR / "zero3_teacher.json", training,
        student_hidden_size=pair.student.hidden_size, teacher_hidden_size=pair.teacher.hidden_size,
        world_size=distributed.world_size())
    teacher_model = pairs.build(pair.teacher, teacher_cfg, args.dtype, device, "sdpa") if teacher is None else None
    tokenizer = word_tokenizer(pair.student.vocab_size, args.out / "tokenizer") if rewards.on else None
    distiller = Timed(student, teacher_model if teacher is None else teacher, loss=MODES[mode],
                      training=training, student_ds_config=student_cfg, teacher_ds_config=teacher_cfg,
                      tokenizer=tokenizer, data=DataFacts(kind="chat"))
    length = args.prompt_len + args.new_tokens
    generator = torch.Generator().manual_seed(args.seed + distributed.rank())
    batches = []
    for _ in range(training.max_steps * accumulation):  # with groups: micro_batch / G prompts, each sampled G times
        ids = torch.randint(1, pair.student.vocab_size - 1, (micro_batch // group, length), generator=generator)
        labels = ids.clone()
        labels[:, :args.prompt_len] = -100  # the prompt; on-policy replaces the answer with a sample
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    sync(device)
    started = time.perf_counter()
    distiller.train(batches, until=args.warmup)
    sync(device)
    warmup = time.perf_counter() - started
    distiller.make_batch_s = distiller.reward_s = 0.0
    started = time.perf_counter()
    distiller.train(batches)
    sync(device)
    seconds = (time.perf_counter() - started) / args.steps
    rows = micro_batch * accumulation
    result = {"mode": mode, "samples_per_prompt": group, "micro_batch": micro_batch,
              "gradient_accumulation_steps": accumulation, "generation_batch_size": generation_batch,
              "warmup_s": warmup, "step_s": seconds, "answer_tokens_per_s_per_gpu": rows * args.new_tokens / seconds,
              "tokens_per_s_per_gpu": rows * length / seconds,
              "generating_share": distiller.make_batch_s / args.steps / seconds,
              "reward_share": distiller.reward_s / args.steps / seconds,
              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0}
    if hasattr(distiller.student, "destroy"):
        distiller.student.destroy()  # the teacher engine stays: the next run shares it
    print(json.dumps(result), flush=True)
    return result, distiller


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(pairs.PAIRS), default="qwen2-7b-0.5b")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--gen-batch", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--gen-cache", nargs="+", default=["static", "dynamic"],
                        choices=["static", "static-repeat-kv", "static-eager", "dynamic"])
    parser.add_argument("--gen-repeats", type=int, default=2, help="timed calls per point (the fastest is kept)")
    parser.add_argument("--runs", nargs="+", default=["off/16/1/0", "on/16/1/0"],
                        help="step runs, each mode/micro_batch/gradient_accumulation/generation_batch_size"
                             "[/samples_per_prompt], mode off, on, opd or opd_reward")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], choices=["generate", "step"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="on_policy", help="results go to <out>/<name>.json, rewritten after "
                                                             "each measurement")
    args = parser.parse_args()
    device = distributed.init()
    results = {"command": " ".join(sys.argv), "world_size": distributed.world_size(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "env": {k: v for k, v in os.environ.items() if k.startswith(("TRANSFORMERS_", "TORCHINDUCTOR_"))},
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}

    def record() -> None:
        if distributed.is_main():
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2))

    record()
    if "generate" not in args.skip and distributed.is_main():
        results["generate"] = []
        results["generate"] = measure_generation(args, device, record)
        record()
    distributed.barrier()
    if "step" not in args.skip:
        # Every run's student is built before the first Distiller: Liger (the teacher's kernels) replaces the
        # architecture's RMSNorm and MLP classes for the whole process, so a student built after it would carry
        # Liger's modules (the library loads both models before patching either; a ZeRO-2 student is built whole).
        students = [pairs.build(pairs.PAIRS[args.pair].student, {}, args.dtype, device, "sdpa") for _ in args.runs]
        results["step"], teacher = [], None
        for run, student in zip(args.runs, students, strict=True):
            result, distiller = measure_step(args, device, run, teacher, student)
            teacher = distiller.teacher
            results["step"].append(result)
            record()


if __name__ == "__main__":
    main()
