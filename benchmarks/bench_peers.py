"""distill-kit against TRL 1.16 (``DistillationTrainer``, ``GKDTrainer``): the same models, data and loss, one launch.

Each run is one process (accelerate keeps process-wide state, and a run that runs out of memory must not leave
anything behind for the next), started by this script in turn on the same GPU; a run is
``FRAMEWORK@MICRO_BATCH[+OPTION...]``:

* ``ours``: the Distiller as ``bench_step.py`` builds its headline run (ZeRO-2 student, ZeRO-3 teacher,
  ``bucket+liger+fused``: Liger kernels in both models, the fused student head and the teacher's head at the
  chunked loss, fused AdamW);
* ``distill``: TRL's ``DistillationTrainer`` (its chunked divergence over hidden states and head weights), the
  teacher through accelerate's DeepSpeed ZeRO-3 (``prepare_deepspeed``; TRL gives the student the same stage),
  ``use_liger_kernel=True`` (Liger's kernels in the student; TRL patches no teacher), fused AdamW (transformers'
  default), no gradient checkpointing (TRL's default turns it on; its PR #6942 benchmark turns it off);
* ``gkd``: TRL's ``GKDTrainer`` (full logits of both models, its ``generalized_jsd_loss``), the same DeepSpeed and
  Liger settings.

Options: ``on`` (on-policy: the student samples the row's rest after a ``--prompt-len`` prompt, every step;
TRL's generation is transformers' ``generate``, without vLLM: vLLM does not run on the GPU machine), ``rkl`` /
``jsd`` (reverse KL, DistillationTrainer's default ``beta=1``; JSD ``beta=0.5``, GKD's default) instead of forward
KL, ``z2`` (TRL under ZeRO-2: the student ZeRO-2 and the teacher replicated, stage 0, as ``prepare_deepspeed``
does for any stage but 3), ``gc`` (gradient checkpointing on, TRL's default).

Every model gets the same weights whatever builds it (``seeded_init``: each parameter drawn from a generator
seeded by its name), and every framework reads the same rows: off-policy, a one-token prompt and the rest as the
completion, so each loss counts the same ``B x (T - 1)`` positions; temperature 1. So the loss each reports on the
first batch (before any update) must agree with ours off-policy (the second table's "rel. diff"); on-policy the
samples differ, and so do the losses. DistillationTrainer has no off-policy mode (it always samples): off-policy,
its generation returns the data's completions (``_generate_single_turn``), and the rest of its step is its own.

Per run: tokens/s per GPU (every forwarded token, median step after ``--warmup``), peak memory
(``torch.cuda.max_memory_allocated``, weights and optimizer included), the first batch's loss. A run given several
micro-batches (``ours@16,32``) tries them in increasing order until one runs out of memory; the largest that ran is
recorded. A run that would end past ``--budget-s`` is not attempted (and recorded so). Results: ``OUT/peers.json`` and
``OUT/peers.md``, rewritten after every run; each run's log in ``OUT/logs/``.

GPU (one H200; under 9 minutes, cold compiles and the wheels' install included: ``--budget-s`` is the deadline for
the last run to end, by the longest run of its kind so far; ``.whl`` carries trl 1.16.0, the rest is in the image or
in ``.whl`` already). The device returns at most 8 files, so the logs come back as one archive::

    source .whl/env.sh && python3 benchmarks/bench_peers.py --out /tmp/peers; \\
        cp /tmp/peers/peers.json /tmp/peers/peers.md $OUT/ && tar czf $OUT/peers_logs.tgz -C /tmp/peers logs

On a machine with a network, ``pip install -e .[peers]`` installs TRL (the ``peers`` extra, trl==1.16.0; TRL is
in no other extra). Wheels for the offline GPU machine, Python 3.12 manylinux x86_64, into ``.whl/`` (every other
requirement of TRL is in the machine's image or already in ``.whl``: accelerate, datasets, pandas, pyarrow,
psutil, jinja2, huggingface_hub, liger-kernel)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d .whl trl==1.16.0

CPU smoke (tiny models, fp32, no Liger, a couple of steps; TRL's runs only where ``trl`` imports)::

    python benchmarks/bench_peers.py --smoke --out /tmp/peers
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 2**30
FRAMEWORKS = {
    "ours": "distill-kit Distiller: ZeRO-2 student, ZeRO-3 teacher, bucket+liger+fused (bench_step.py's headline)",
    "distill": "TRL DistillationTrainer: chunked divergence, ZeRO-3 student and teacher (accelerate), Liger student",
    "gkd": "TRL GKDTrainer: full logits, ZeRO-3 student and teacher (accelerate), Liger student",
}
OPTIONS = {
    "on": "on-policy: the student samples every completion (TRL: transformers' generate, no vLLM)",
    "rkl": "reverse KL (DistillationTrainer's default, beta=1) instead of forward KL",
    "jsd": "generalized JSD beta=0.5 (GKDTrainer's default) instead of forward KL",
    "z2": "TRL under ZeRO-2: student ZeRO-2, teacher replicated (prepare_deepspeed's stage 0)",
    "gc": "gradient checkpointing on (TRL's default; off in its PR #6942 benchmark)",
}
# The divergence each option names: our registry's loss, and TRL's beta (0 forward KL, 1 reverse KL).
DIVERGENCES = {"fkl": ({"name": "forward_kl"}, 0.0), "rkl": ({"name": "reverse_kl"}, 1.0),
               "jsd": ({"name": "generalized_jsd", "beta": 0.5}, 0.5)}
# The default launch on one H200, in order (about 8 minutes with the default steps; what --budget-s cannot fit is
# recorded as not attempted): every framework at the same micro-batch on both pairs first, then the searches for
# the largest micro-batch (each continues where the same run left off), then on-policy.
GPU_RUNS = [("qwen2-7b-0.5b", "ours@16"), ("qwen2-7b-0.5b", "distill@16"), ("qwen2-7b-0.5b", "gkd@16"),
            ("llama3.2-1b-1b", "ours@32"), ("llama3.2-1b-1b", "distill@32"), ("llama3.2-1b-1b", "gkd@32"),
            ("qwen2-7b-0.5b", "ours@32,48"), ("qwen2-7b-0.5b", "distill@32"),
            ("qwen2-7b-0.5b", "ours@16+on"), ("qwen2-7b-0.5b", "distill@16+on"), ("qwen2-7b-0.5b", "distill@16+z2"),
            ("qwen2-7b-0.5b", "gkd@32")]
SMOKE_RUNS = [("tiny", run) for run in ("ours@2,3", "distill@2", "gkd@2", "ours@2+on", "distill@2+on", "gkd@2+on",
                                        "ours@2+rkl", "distill@2+rkl", "ours@2+jsd", "gkd@2+jsd")]


@dataclass(frozen=True)
class Run:
    framework: str
    micro_batches: tuple[int, ...]
    options: tuple[str, ...]

    @property
    def divergence(self) -> str:
        return next((o for o in self.options if o in ("rkl", "jsd")), "fkl")

    @property
    def on_policy(self) -> bool:
        return "on" in self.options

    def label(self, micro_batch: int) -> str:
        return f"{self.framework}@{micro_batch}" + "".join(f"+{o}" for o in self.options)

    @property
    def key(self) -> str:
        """The label without its micro-batch: what a largest-micro-batch search compares."""
        return self.framework + "".join(f"+{o}" for o in self.options)


def parse_run(text: str) -> Run:
    head, *options = text.split("+")
    framework, _, micro = head.partition("@")
    bad = [o for o in options if o not in OPTIONS]
    if framework not in FRAMEWORKS or not micro or bad or ("rkl" in options and "jsd" in options):
        raise argparse.ArgumentTypeError(
            f"bad run {text!r}: FRAMEWORK@MB[,MB...][+OPTION...] with FRAMEWORK in {sorted(FRAMEWORKS)}, OPTION in "
            f"{sorted(OPTIONS)} (at most one of rkl, jsd), e.g. distill@16,32+on")
    if framework == "ours" and ({"z2", "gc"} & set(options)):
        raise argparse.ArgumentTypeError(f"bad run {text!r}: z2 and gc are TRL options")
    return Run(framework, tuple(sorted({int(m) for m in micro.split(",")})), tuple(sorted(options)))


# --- shared by every framework: weights, rows, timing ------------------------------------------------------------


def parse_planned(text: str) -> tuple[str, Run]:
    """``PAIR:RUN``: a run (:func:`parse_run`) on one pair of ``pairs.py``."""
    pair, sep, run = text.partition(":")
    if not sep or not pair:
        raise argparse.ArgumentTypeError(f"bad plan entry {text!r}: expected PAIR:RUN, e.g. qwen2-7b-0.5b:ours@16")
    return pair, parse_run(run)


def seeded_init(model: Any, seed: int) -> None:
    """Give ``model`` the same weights whatever built it: each parameter drawn from a generator seeded by its name
    (normal, std ``initializer_range``; norms 1, biases 0), gathered first when ZeRO-3 has partitioned it."""
    import deepspeed
    import torch

    std = getattr(model.config, "initializer_range", 0.02)
    for name, param in model.named_parameters():
        gathered = (deepspeed.zero.GatheredParameters([param], modifier_rank=0) if hasattr(param, "ds_id")
                    else contextlib.nullcontext())
        with gathered, torch.no_grad():
            if param.ndim == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
                continue
            generator = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * std)


def rows(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` rows of random token ids in [1, vocab - 1): 0 is the pad token and vocab - 1 the end token. Row i
    is the same whatever ``count``, so every micro-batch's first batch starts with the same rows."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (length,), generator=generator).tolist() for _ in range(count)]


def device_stats(device: Any) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}


def speed(step_ms: list[float], warmup: int, tokens_per_step: int) -> dict[str, Any]:
    timed = step_ms[warmup:] or step_ms
    median = statistics.median(timed)
    return {"step_ms": median, "step_ms_all": step_ms, "tokens_per_step_per_gpu": tokens_per_step,
            "tokens_per_s_per_gpu": tokens_per_step / (median / 1e3),
            "first_step_extra_s": (step_ms[0] - median) / 1e3}


class Stamps:
    """CUDA events (host clocks on the CPU) at step boundaries, read once after training: no added waits."""

    def __init__(self, device: Any):
        self.cuda = device.type == "cuda"
        self.events: list[Any] = []

    def stamp(self) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.events.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(self.events, self.events[1:], strict=False)]


# --- the workers: one run at one micro-batch, in its own process ---------------------------------------------------


def shape(args: argparse.Namespace, on_policy: bool) -> tuple[int, int]:
    """(prompt, completion) lengths: off-policy a one-token prompt, so every framework's loss counts T - 1
    positions per row; on-policy ``--prompt-len`` and the sampled rest."""
    prompt = args.prompt_len if on_policy else 1
    return prompt, args.seq_len - prompt


def run_ours(run: Run, micro_batch: int, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import bench_step
    import pairs
    import torch
    from phases import TimedDistiller

    from distill_kit import TrainingConfig
    from distill_kit.config import CONFIG_DIR, OnPolicyConfig
    from distill_kit.engines import deepspeed_config, distributed
    from losses import build_loss

    pair = pairs.PAIRS[args.pair]
    vocab = pair.student.vocab_size
    prompt, completion = shape(args, run.on_policy)
    levers = ("bucket", "fused", "liger") if device.type == "cuda" else ("bucket",)
    # "auto" is what a run config gets: Liger in both models off-policy; when the student samples, none in the
    # student and no RoPE kernel in the teacher, so that the student's static-cache decode step compiles whole
    # (training/on_policy.py's student_kernels, engines/kernels.py's teacher_liger). An explicit "liger" would keep
    # them, and the decode step then falls back to eager (docs: benchmarks/results/on-policy.md).
    kernels = "auto" if "liger" in levers else "none"
    sampling = OnPolicyConfig(fraction=1.0 if run.on_policy else 0.0, max_new_tokens=completion, temperature=1.0,
                              eos_token_id=vocab - 1, pad_token_id=0)
    steps = args.warmup + args.steps
    training = TrainingConfig(max_steps=steps, micro_batch_size=micro_batch, dtype=args.dtype, lr=1e-5,
                              log_every=10**9, teacher_kernels=kernels, student_kernels=kernels, on_policy=sampling)
    student_overrides, teacher_overrides = bench_step.ds_overrides(bench_step.Run("ours", micro_batch, levers), args)
    student_cfg, teacher_cfg = deepspeed_config.prepare_pair(
        CONFIG_DIR / "zero2_student.json", CONFIG_DIR / "zero3_teacher.json", training,
        student_hidden_size=pair.student.hidden_size, teacher_hidden_size=pair.teacher.hidden_size,
        world_size=distributed.world_size(), student_overrides=student_overrides, teacher_overrides=teacher_overrides)
    teacher = pairs.build(pair.teacher, teacher_cfg, args.dtype, device, "sdpa")  # teacher first, as the Distiller
    seeded_init(teacher, args.seed)
    student = pairs.build(pair.student, student_cfg, args.dtype, device, "sdpa")
    seeded_init(student, args.seed + 1)
    loss = build_loss({**DIVERGENCES[run.divergence][0], "chunk_size": args.chunk_size})
    distiller = TimedDistiller(student, teacher, loss=loss, training=training, student_ds_config=student_cfg,
                               teacher_ds_config=teacher_cfg)
    batches = []
    data = rows(steps * micro_batch, args.seq_len, vocab, args.seed)
    for i in range(steps):
        ids = torch.tensor(data[i * micro_batch:(i + 1) * micro_batch])
        labels = ids.clone()
        labels[:, :prompt] = -100  # the prompt: the loss counts the completion's positions (on-policy: sampled)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    history = distiller.train(batches)
    distiller.clock.finish()
    summary = distiller.clock.summary(skip=0)
    return {"losses": [h["loss"] for h in history], **speed(summary["step_ms_all"], args.warmup,
                                                             micro_batch * args.seq_len),
            "phase_ms": distiller.clock.summary(skip=args.warmup)["phase_ms"], "kernels": kernels,
            "levers": list(levers), "optimizer": innermost_optimizer(distiller.student.optimizer)}


def trl_deepspeed(stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """TRL's DeepSpeed config: transformers' documented ZeRO config with "auto" values, and the ZeRO-3 sizes ours
    uses (``prepare_deepspeed`` means to set them from the hidden size, but writes dotted keys DeepSpeed ignores)."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": int(5e8)}
    if stage == 3:
        zero |= {k.removeprefix("zero_optimization."): v for k, v in args.zero3}
        zero |= {"stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": False}
    return {"bf16": {"enabled": "auto"}, "zero_optimization": zero, "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "steps_per_print": 10**9}


def tokenizer(vocab: int) -> Any:
    """A tokenizer object TRL can hold (it reads only the pad and end ids here): 0 pads, vocab - 1 ends."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    model = WordLevel({"<pad>": 0, "<unk>": 1, "<eos>": vocab - 1}, unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def run_trl(run: Run, micro_batch: int, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import pairs
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    pair = pairs.PAIRS[args.pair]
    vocab = pair.student.vocab_size
    prompt, completion = shape(args, run.on_policy)
    steps, cuda = args.warmup + args.steps, device.type == "cuda"
    stage = 2 if "z2" in run.options else 3
    beta = DIVERGENCES[run.divergence][1]
    common = dict(output_dir=tempfile.mkdtemp(prefix="peers_"), per_device_train_batch_size=micro_batch,
                  gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-5, logging_steps=10**6,
                  save_strategy="no", report_to=[], bf16=args.dtype == "bf16", use_cpu=not cuda,
                  gradient_checkpointing="gc" in run.options, use_liger_kernel=cuda,
                  deepspeed=trl_deepspeed(stage, args), seed=args.seed, dataloader_num_workers=0,
                  disable_tqdm=True, max_grad_norm=1.0)
    data = rows(steps * micro_batch, args.seq_len, vocab, args.seed)
    if run.framework == "distill":
        config = DistillationConfig(**common, beta=beta, temperature=1.0, max_completion_length=completion,
                                    shuffle_dataset=False, top_k=0, top_p=1.0)
        dataset = Dataset.from_dict({"prompt": [r[:prompt] for r in data], "completion": [r[prompt:] for r in data]})
    else:
        config = GKDConfig(**common, beta=beta, lmbda=1.0 if run.on_policy else 0.0, temperature=1.0,
                           max_new_tokens=completion, max_length=args.seq_len, seq_kd=False)
        dataset = Dataset.from_dict({"input_ids": data})
    # Built after the config, as from_pretrained would be under it: ZeRO-3 models partitioned at construction.
    placement = contextlib.nullcontext() if stage == 3 else torch.device(device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    models = []
    for config_, seed in ((pair.teacher, args.seed), (pair.student, args.seed + 1)):
        with placement:
            model = AutoModelForCausalLM.from_config(config_, dtype=dtype, attn_implementation="sdpa")
        seeded_init(model, seed)
        models.append(model)
    teacher, student = models
    for model in models:
        model.generation_config.eos_token_id = vocab - 1
        model.generation_config.pad_token_id = 0
    stamps, losses = Stamps(device), []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.stamp()

        def on_step_end(self, *a, **k):
            stamps.stamp()

    class Recorded:
        """The trainer's own step; only the loss it computes is kept (a detached tensor: no added wait)."""

        def compute_loss(self, *a, **k):
            loss = super().compute_loss(*a, **k)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).detach())
            return loss

    if run.framework == "distill":
        class Trainer(Recorded, DistillationTrainer):
            def _tokenize_prompts(self, prompts):  # the rows are token ids already
                return [list(p) for p in prompts], None, {}

            def _generate_and_score_completions(self, inputs):
                self._given = [x["completion"] for x in inputs]
                return super()._generate_and_score_completions(inputs)

            if not run.on_policy:
                def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
                    return self._given  # off-policy: the data's completions in place of samples

        trainer = Trainer(model=student, teacher_model=teacher, args=config, train_dataset=dataset,
                          processing_class=tokenizer(vocab), callbacks=[Clock()])
    else:
        def collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            ids = torch.tensor([e["input_ids"] for e in examples])
            labels = ids.clone()
            labels[:, :prompt] = -100
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                    "prompts": ids[:, :prompt], "prompt_attention_mask": torch.ones_like(ids[:, :prompt])}

        class Trainer(Recorded, GKDTrainer):
            def _get_train_sampler(self, dataset=None):  # the same first batch as the others
                return SequentialSampler(dataset if dataset is not None else self.train_dataset)

        trainer = Trainer(model=student, teacher_model=teacher, args=config, train_dataset=dataset,
                          data_collator=collate, processing_class=tokenizer(vocab), callbacks=[Clock()])
    trainer.train()
    step_ms = stamps.step_ms()
    return {"losses": [loss.item() for loss in losses], **speed(step_ms, args.warmup, micro_batch * args.seq_len),
            "zero_stage": stage, "liger": cuda, "gradient_checkpointing": "gc" in run.options,
            "optimizer": innermost_optimizer(trainer.optimizer)}


def innermost_optimizer(optimizer: Any) -> str:
    """The torch optimizer under accelerate's and DeepSpeed's wrappers."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return type(optimizer).__name__


def worker(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One run at one micro-batch: its result, or its status when it ran out of memory."""
    import torch

    from distill_kit.engines import distributed

    device = distributed.init()
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    import transformers

    transformers.logging.set_verbosity_error()
    run, micro_batch = Run(spec["framework"], (spec["micro_batch"],), tuple(spec["options"])), spec["micro_batch"]
    started = time.perf_counter()
    result = {"label": run.label(micro_batch), "key": run.key, "framework": run.framework, "micro_batch": micro_batch,
              "options": list(run.options), "divergence": run.divergence,
              "policy": "on" if run.on_policy else "off", "pair": args.pair}
    try:
        measured = (run_ours if run.framework == "ours" else run_trl)(run, micro_batch, args, device)
        result |= {"status": "ok", "first_batch_loss": measured["losses"][0], **measured, **device_stats(device)}
    except torch.OutOfMemoryError as err:
        result |= {"status": "out of memory", "error": str(err).splitlines()[0][:300], **device_stats(device)}
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result["wall_s"] = time.perf_counter() - started
    return result


# --- the launch: every run in its own process, then the table ------------------------------------------------------


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def trl_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:  # noqa: BLE001 - not installed: TRL's runs are skipped
        return None


def launch(pair: str, run: Run, micro_batch: int, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One run in a fresh process; its result JSON, or what killed it."""
    label = run.label(micro_batch)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out_json = logs / f"{pair}_{label}.json"
    out_json.unlink(missing_ok=True)
    spec = {"framework": run.framework, "micro_batch": micro_batch, "options": list(run.options)}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec),
               "--worker-out", str(out_json), *args.passthrough, "--pair", pair]
    env = os.environ | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    with open(logs / f"{pair}_{label}.log", "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                  cwd=HERE.parent).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    described = {"label": label, "key": run.key, "framework": run.framework, "micro_batch": micro_batch,
                 "options": list(run.options), "divergence": run.divergence,
                 "policy": "on" if run.on_policy else "off", "pair": pair, "wall_s": time.perf_counter() - started}
    if out_json.exists():
        return json.loads(out_json.read_text()) | {"wall_s": described["wall_s"]}
    tail = (logs / f"{pair}_{label}.log").read_text()[-3000:]
    status = "out of memory" if "out of memory" in tail.lower() else f"failed (exit {code})"
    return described | {"status": status, "error": tail[-600:]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Largest micro-batch per run, each TRL run against ours (same pair, policy, divergence) at the same
    micro-batch and each at its largest, and the first-batch losses side by side."""
    ok = [r for r in runs if r["status"] == "ok"]
    largest: dict[tuple[str, str], dict[str, Any]] = {}
    for r in ok:
        best = largest.get((r["pair"], r["key"]))
        if best is None or r["micro_batch"] > best["micro_batch"]:
            largest[(r["pair"], r["key"])] = r
    comparisons = []
    for r in ok:
        if r["framework"] == "ours":
            continue
        same = [o for o in ok if o["framework"] == "ours" and o["pair"] == r["pair"] and o["policy"] == r["policy"]
                and o["divergence"] == r["divergence"]]
        equal = next((o for o in same if o["micro_batch"] == r["micro_batch"]), None)
        if equal:
            ours_loss = equal["first_batch_loss"]
            loss_diff = abs(r["first_batch_loss"] - ours_loss) / max(abs(ours_loss), 1e-12)
            comparisons.append({"pair": r["pair"], "peer": r["label"], "ours": equal["label"],
                                "basis": "same micro-batch",
                                "speedup": equal["tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"],
                                "first_batch_loss": [equal["first_batch_loss"], r["first_batch_loss"]],
                                "loss_rel_diff": loss_diff})
    for (pair, _), r in largest.items():
        if r["framework"] == "ours":
            continue
        ours = [o for (p, _), o in largest.items() if p == pair and o["framework"] == "ours"
                and o["policy"] == r["policy"] and o["divergence"] == r["divergence"]]
        if ours:
            best = max(ours, key=lambda o: o["tokens_per_s_per_gpu"])
            comparisons.append({"pair": pair, "peer": r["label"], "ours": best["label"],
                                "basis": "each at its largest micro-batch",
                                "speedup": best["tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"]})
    return {"largest_micro_batch": {f"{p} {k}": r["micro_batch"] for (p, k), r in largest.items()},
            "comparisons": comparisons}


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [f"# distill-kit against TRL {meta['versions'].get('trl')} ({meta['machine']}, {meta['date']})", "",
             f"`{meta['command']}`", "",
             f"Sequence {meta['seq_len']} tokens ({meta['dtype']}); off-policy: a 1-token prompt; on-policy: "
             f"{meta['prompt_len']}-token prompt + {meta['seq_len'] - meta['prompt_len']} sampled tokens. "
             f"Median step after {meta['warmup']} warm-up steps of {meta['warmup'] + meta['steps']}.", "",
             "| pair | run | policy | divergence | micro-batch | tokens/s/GPU | peak GiB | first-batch loss | status |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in result["runs"]:
        ok = r["status"] == "ok"
        lines.append(f"| {r['pair']} | {r['label']} | {r['policy']} | {r['divergence']} | {r['micro_batch']} | "
                     + (f"{r['tokens_per_s_per_gpu']:,.0f}" if ok else "") + " | "
                     + (f"{r['peak_allocated_gib']:.1f}" if r.get("peak_allocated_gib") is not None else "") + " | "
                     + (f"{r['first_batch_loss']:.6g}" if ok else "") + f" | {r['status']} |")
    summary = result["summary"]
    lines += ["", "| pair | ours | peer | basis | ours / peer tokens/s | first-batch loss (ours, peer) | rel. diff |",
              "|---|---|---|---|---:|---|---:|"]
    for c in summary["comparisons"]:
        losses = c.get("first_batch_loss")
        lines.append(f"| {c['pair']} | {c['ours']} | {c['peer']} | {c['basis']} | {c['speedup']:.2f}x | "
                     + (f"{losses[0]:.6g}, {losses[1]:.6g}" if losses else "") + " | "
                     + (f"{c['loss_rel_diff']:.1e}" if "loss_rel_diff" in c else "") + " |")
    lines += ["", "Largest micro-batch that ran: " + ", ".join(f"{k} {v}" for k, v in
                                                               summary["largest_micro_batch"].items()), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for peers.json, peers.md and logs/")
    parser.add_argument("--smoke", action="store_true", help="the CPU smoke run: tiny pair, fp32, a few steps")
    parser.add_argument("--pairs", nargs="+", default=None,
                        help="pairs.py's pairs to run (default: the GPU launch's two, or tiny with --smoke)")
    parser.add_argument("--runs", nargs="+", type=parse_run, default=None,
                        help="FRAMEWORK@MB[,MB...][+OPTION...] for every pair (default: each pair's own list); "
                        "frameworks: " + "; ".join(f"{k}: {v}" for k, v in FRAMEWORKS.items()) + "; options: "
                        + "; ".join(f"{k}: {v}" for k, v in OPTIONS.items()))
    parser.add_argument("--plan", nargs="+", type=parse_planned, default=None,
                        help="PAIR:RUN ..., each run on its own pair, in this order (instead of --pairs and --runs), "
                        "e.g. qwen2-7b-0.5b:distill@32 qwen2-32b-0.5b:ours@8")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 1024; smoke 16)")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="on-policy prompt tokens; the student samples the rest (default 768; smoke 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; smoke 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 4; smoke 2)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPUs, fp32 on CPUs")
    parser.add_argument("--chunk-size", type=int, default=1024, help="our logit loss's rows per chunk")
    parser.add_argument("--budget-s", type=float, default=470.0,
                        help="seconds by which the last run must end: a run starts only if the longest run of its "
                        "framework and policy so far (60 s before the first on a GPU) fits in what is left")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pair", default=None, help=argparse.SUPPRESS)  # a worker's pair
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a worker's run (JSON)
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {"seq_len": (16, 1024), "prompt_len": (8, 768), "warmup": (1, 2), "steps": (2, 4)}
    for name, (smoke, gpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else gpu)
    if not 0 < args.prompt_len < args.seq_len:
        parser.error(f"--prompt-len must be between 1 and --seq-len - 1 ({args.seq_len - 1}), got {args.prompt_len}")
    if args.worker is None and args.out is None:
        parser.error("--out is required")
    # What every worker is given again (the launch's settings, not its run list).
    args.passthrough = ["--seq-len", str(args.seq_len), "--prompt-len", str(args.prompt_len), "--warmup",
                        str(args.warmup), "--steps", str(args.steps), "--chunk-size", str(args.chunk_size),
                        "--seed", str(args.seed), *(["--dtype", args.dtype] if args.dtype else [])]
    if args.worker is not None:  # the heavy imports only where a run is made
        import bench_step  # the ZeRO-3 sizes ours uses for every ZeRO-3 model, given to TRL's too

        args.zero3 = bench_step.parse_args(["--out", "unused"]).zero3
    elif args.pairs or args.plan:
        import pairs

        named = set(args.pairs or []) | {pair for pair, _ in args.plan or []}
        if unknown := sorted(named - set(pairs.PAIRS)):
            parser.error(f"unknown pairs {unknown}: pairs.py has {sorted(pairs.PAIRS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        result = worker(json.loads(args.worker), args)
        args.worker_out.write_text(json.dumps(result, indent=2))
        return
    import torch

    defaults = SMOKE_RUNS if args.smoke else GPU_RUNS
    pairs_ = args.pairs or list(dict.fromkeys(pair for pair, _ in defaults))
    if args.plan:  # each run on its own pair, in the order given
        plan = list(args.plan)
        pairs_ = list(dict.fromkeys(pair for pair, _ in plan))
    elif args.runs:  # every given run on every pair, pair by pair
        plan = [(pair, run) for pair in pairs_ for run in args.runs]
    else:  # the default list's entries for these pairs
        plan = [(pair, parse_run(run)) for pair, run in defaults if pair in pairs_]
    trl = trl_version()
    cuda = torch.cuda.is_available()  # no CUDA context here: the workers get the whole GPU
    result: dict[str, Any] = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": "CPU" if not cuda else "GPU (the runs' device)",
                 "command": "python benchmarks/bench_peers.py " + shlex.join(sys.argv[1:]),
                 "seq_len": args.seq_len, "prompt_len": args.prompt_len, "dtype": args.dtype or
                 ("bf16" if cuda else "fp32"), "warmup": args.warmup, "steps": args.steps,
                 "chunk_size": args.chunk_size, "frameworks": FRAMEWORKS, "options": OPTIONS,
                 "plan": [{"pair": pair, **asdict(run)} for pair, run in plan],
                 "versions": {"torch": torch.__version__, "trl": trl}},
        "runs": [],
    }
    started = time.perf_counter()
    estimate: dict[tuple[str, bool], float] = {}  # the longest run so far per framework and policy
    for pair, run in plan:
        for micro_batch in run.micro_batches:
            last = [r for r in result["runs"] if r["pair"] == pair and r["key"] == run.key]
            left = args.budget_s - (time.perf_counter() - started)
            described = {"label": run.label(micro_batch), "key": run.key, "framework": run.framework,
                         "micro_batch": micro_batch, "options": list(run.options), "divergence": run.divergence,
                         "policy": "on" if run.on_policy else "off", "pair": pair}
            if last and last[-1]["status"] != "ok":
                break  # a smaller micro-batch already ran out of memory (or failed)
            if run.framework != "ours" and trl is None:
                result["runs"].append(described | {"status": "skipped: trl is not installed"})
                break
            if left < estimate.get((run.framework, run.on_policy), 60.0 if cuda else 0.0):
                result["runs"].append(described | {"status": f"not attempted: {left:.0f} s of --budget-s left"})
                break
            outcome = launch(pair, run, micro_batch, args, timeout=max(left, 60.0))
            key = (run.framework, run.on_policy)
            estimate[key] = max(estimate.get(key, 0.0), outcome["wall_s"])
            result["runs"].append(outcome)
            result["meta"]["machine"] = outcome.get("device", result["meta"]["machine"])
            result["summary"] = summarize(result["runs"])
            result["meta"]["wall_s"] = time.perf_counter() - started
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "peers.json").write_text(json.dumps(result, indent=2))
            (args.out / "peers.md").write_text(markdown(result))
            print(f"{pair} {outcome['label']}: {outcome['status']}"
                  + (f", {outcome['tokens_per_s_per_gpu']:,.0f} tokens/s, loss {outcome['first_batch_loss']:.6g}"
                     if outcome["status"] == "ok" else ""), flush=True)
    result["summary"] = summarize(result["runs"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(result, indent=2))
    (args.out / "peers.md").write_text(markdown(result))
    print(markdown(result), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
