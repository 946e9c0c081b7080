"""Every typed setting of a run, on the ground floor: the same dataclasses for a YAML run config, command-line
overrides and Python, and the one loader that builds them from plain dicts.

One concept, one dataclass: :class:`TrainingConfig` (the step and the optimizer; ``on_policy`` inside it),
:class:`StudentSpec` and :class:`TeacherSpec` (a model of the run), :class:`AdapterConfig` (LoRA),
:class:`FromTeacherConfig` (a student cut from its teacher), :class:`EvalConfig` and :class:`TaskConfig`. The data's
is :class:`distill_kit.data.blocks.DataConfig`. :func:`build` turns a mapping into any of them: unknown keys are
errors naming the closest valid key, values are converted to the field's type or refused with a ``ConfigError``.
The help text of every field is the string under it (``field_docs``), so ``--help`` and the code never disagree.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import math
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from distill_kit.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The shipped DeepSpeed configs: ``zero2_student.json`` and ``zero3_teacher.json`` are every run's defaults."""

Kernels = Literal["none", "liger", "compile", "auto"]
CHOICES = ("none", "liger", "compile", "auto")
Precision = Literal["auto", "bf16", "fp8"]


def check_teacher_precision(precision: str, dtype: str, precision_key: str, dtype_key: str) -> None:
    """``bf16`` names a bf16 run's teacher: a teacher that is not FP8 runs in the run's dtype, so in another dtype
    ``bf16`` would silently mean that dtype (a training run's and a capture's rule)."""
    if precision == "bf16" and dtype != "bf16":
        raise ValueError(f"{precision_key} 'bf16' with {dtype_key} {dtype!r}: a teacher that is not FP8 runs in the "
                         f"run's dtype; set {dtype_key} bf16, or {precision_key.rpartition('.')[2]} auto (the run's "
                         "dtype) or fp8")


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


SEEDS = 2**32
"""Seeds run from 0 to 2**32 - 1: a run seeds numpy's generator with each (``transformers.set_seed``, the data's
shuffles), and numpy takes no other."""


def check_seed(value: Any, key: str) -> None:
    """Refuse a seed outside 0 .. 2**32 - 1 (or not a whole number) at config time, before anything is written:
    numpy would refuse it only once the run has begun."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEEDS:
        raise ConfigError(f"{key}: {value!r} is not a seed; give a whole number from 0 to {SEEDS - 1} (2**32 - 1: "
                          "numpy's generators, which the run seeds with it, take no other)")


def check_kernels(choice: str, key: str) -> None:
    """What can be checked before any model exists: the name, and that Liger is installed if asked for (the
    architecture is ``engines/kernels.py``'s ``check_model_type``)."""
    if choice not in CHOICES:
        raise ValueError(f"{key} {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "liger" and not liger_installed():
        raise ValueError(f"{key} 'liger' needs liger-kernel: pip install 'distill-kit[liger]' (or liger-kernel), "
                         "or set it to 'none' or 'compile'")



@dataclass
class OnPolicyConfig:
    """Which rows of a micro-batch a model answers itself, and how it samples.

    Off by default (``fraction: 0``): the batch is used exactly as the data gives it.
    """

    fraction: float = 0.0
    """lambda in GKD: the share of each micro-batch's rows answered by samples (0 = off-policy, 1 = every row).
    Rows without an answer (prompts) are chosen first, the rest at random; unchosen prompts count no tokens."""
    sampler: Literal["student", "teacher"] = "student"
    """Who writes the samples: 'student' is on-policy distillation; 'teacher' is sequence-level KD (the teacher's
    ZeRO-3 generate steps every rank together at every token: slower than a student's;
    docs/chat.md#on-policy-distillation-and-sequence-level-kd)."""
    max_new_tokens: int = 64
    """Longest sample; a sample cut here has no end token and every one of its tokens counts."""
    temperature: float = 1.0
    """Sampling temperature; 0 decodes greedily."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 keeps the whole distribution (GKD samples from it unchanged)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    generation_batch_size: int = 0
    """Rows per ``generate`` call. 0: each micro-batch samples its own rows, one call each. N > 0: the chosen rows
    of all of a step's micro-batches (``gradient_accumulation_steps`` of them) are sampled together, in calls of
    min(N, the step's rows) rows, the last padded with copies of a prompt, so that small micro-batches sample at
    a large batch's speed (decoding a small student is bound by per-token overhead, not arithmetic; see
    benchmarks/RESULTS.md) and a compiled static-cache decode step sees one batch size. Choose N dividing the
    step's sampled rows: padding rows are decoded and thrown away."""
    cache: Literal["auto", "static", "dynamic"] = "auto"
    """KV cache of generation: 'auto' is static on an accelerator where the model supports it (faster than a
    dynamic one: benchmarks/RESULTS.md), dynamic on the CPU and for a ZeRO-3 teacher."""
    sdpa_gqa: bool = True
    """Decode with SDPA's own grouped-query attention on an accelerator (transformers' switch
    ``TRANSFORMERS_SDPA_FORCE_GQA``, set only while ``generate`` runs): inside the compiled static-cache decode step
    transformers otherwise copies every key/value head once per query head that shares it, at every token (the
    gain: benchmarks/RESULTS.md)."""
    eos_token_id: int | None = None
    """Token that ends a sample (counted); None reads the sampling model's generation config."""
    pad_token_id: int | None = None
    """Token that pads; None reads the model's config, else uses the end token."""
    max_length: int = 0
    """Longest row a sample may make, prompt included: each sample is cut to fit it (the cut is logged once), so
    that no model reads a row past its positions. 0: the fewest positions (max_position_embeddings) among the
    run's models, which the CLI reads from their configs; from Python, the sampling model's own."""
    pack_to: int = 0
    """Pack each sampled micro-batch's conversations (prompt + sample, and the rows left as they were) into rows
    of up to this many tokens, as ``data.packing`` packs chat data (``data/chat.py``), so that sample lengths that
    vary leave little padding; a conversation longer than it gets a row of its own. 0: right-padded rows. The CLI
    sets it to ``data.block_size`` when ``data.packing: true`` (the loader then hands over unpacked rows, whose
    prompts the sampler reads)."""
    samples_per_prompt: int = 1
    """G: samples of each prompt, drawn in the same generate call (GRPO's group). With G > 1 each row the data
    gives is repeated G times before sampling (its G copies side by side), so a micro-batch of P prompts trains on
    P x G rows: ``micro_batch_size`` counts those rows, and the CLI reads micro_batch_size / G prompts per
    micro-batch. Rewards are normalised within each group (training.rewards). Needs fraction 1."""
    prompt_tokens: int = 0
    """Text data (rows that count every token, and so have no prompt of their own): each sampled row's first
    ``prompt_tokens`` tokens are its prompt, and the sample replaces the rest, e.g. a drafter trained on its teacher's
    greedy continuations (``sampler: teacher, temperature: 0``; docs/drafters.md). 0: the row's own prompt (chat
    data), and on-policy training on text data is refused. Chat rows keep their own prompts: not both."""
    updates_per_rollout: int = 1
    """Optimizer steps on each step's samples (PPO's epochs; TRL's GRPO ``num_iterations``, the GRPO paper's mu).
    1: fresh samples every step. N > 1: the samples (and their rewards) made at one step are trained on again at
    the N - 1 steps after it, which sample nothing and read no data, so sampling costs 1/N of the steps. From the
    second step on they are stale (drawn from older weights): ``policy_gradient`` weighs each token by the ratio of
    its probability now to when it was sampled, clipped to [1 - clip_low, 1 + clip_high] (docs/rewards.md)."""

    def __post_init__(self) -> None:
        checks = {
            "fraction": 0.0 <= self.fraction <= 1.0,
            "sampler": self.sampler in ("student", "teacher"),
            "max_new_tokens": self.max_new_tokens >= 1,
            "temperature": self.temperature >= 0.0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "top_k": self.top_k >= 0,
            "cache": self.cache in ("auto", "static", "dynamic"),
            "generation_batch_size": self.generation_batch_size >= 0,
            "max_length": self.max_length >= 0,
            "pack_to": self.pack_to >= 0,
            "samples_per_prompt": self.samples_per_prompt >= 1,
            "updates_per_rollout": self.updates_per_rollout >= 1,
            "prompt_tokens": self.prompt_tokens >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"on_policy.{name}={getattr(self, name)!r}" for name in bad)
            raise ValueError(f"invalid on-policy settings: {values} (fraction in [0, 1], sampler student or "
                             "teacher, max_new_tokens >= 1, temperature >= 0, top_p in (0, 1], top_k >= 0, "
                             "generation_batch_size >= 0, max_length >= 0, pack_to >= 0, samples_per_prompt >= 1, "
                             "updates_per_rollout >= 1, prompt_tokens >= 0)")
        if self.samples_per_prompt > 1 and self.fraction != 1.0:
            raise ValueError(f"on_policy.samples_per_prompt={self.samples_per_prompt} samples each prompt of a row "
                             f"several times, and on_policy.fraction={self.fraction} leaves some rows unsampled: set "
                             "fraction: 1.0 (every row a prompt to answer) or samples_per_prompt: 1")
        if self.updates_per_rollout > 1 and self.fraction == 0:
            raise ValueError(f"on_policy.updates_per_rollout={self.updates_per_rollout} trains on each step's samples "
                             "again, and on_policy.fraction=0 samples nothing: set fraction > 0 (1.0 with rewards), "
                             "or updates_per_rollout: 1")


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a run (``distill_kit/rewards``): what scores each sample, and its weight in their sum."""

    name: str = ""
    """A registered reward (arithmetic, sorting, or one of your own ``rewards.register``) or
    ``package.module:function``."""
    weight: float = 1.0
    """Its weight in the sample's reward, the weighted sum of every reward that scores the sample."""
    teacher: str | None = None
    """With combine: route, the teacher (by name) whose conversations this reward scores; None scores every
    conversation. Each domain's reward beside its teacher: docs/rewards.md#per-domain-rewards."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("training.rewards.functions: each entry needs a name, e.g. {name: arithmetic, weight: 1}")
        if not (isinstance(self.weight, int | float) and math.isfinite(self.weight)):
            raise ValueError(f"training.rewards.functions[{self.name}].weight: {self.weight!r}; give a finite number")


@dataclass
class RewardsConfig:
    """Task rewards for the student's own samples: each sample's reward is the weighted sum of ``functions``, and
    each group of ``on_policy.samples_per_prompt`` samples of one prompt turns its rewards into advantages (GRPO),
    which a ``policy_gradient`` loss trains on with weight ``reward`` (docs/rewards.md)."""

    functions: tuple[RewardSpec, ...] = ()
    """The rewards, e.g. [{name: arithmetic, weight: 1.0}]; none: the run has no rewards."""
    scale_by_std: bool = True
    """Divide each group's centred rewards by its standard deviation (GRPO). false: centred only (Dr. GRPO), so
    that a group whose samples barely differ (too easy or too hard) weighs less instead of being blown up."""

    def __post_init__(self) -> None:
        self.functions = tuple(RewardSpec(**f) if isinstance(f, Mapping) else f for f in self.functions)

    @property
    def on(self) -> bool:
        return bool(self.functions)


DType = Literal["fp32", "bf16", "fp16"]
LRSchedule = Literal["linear", "cosine", "constant"]
Residency = Literal["resident", "paged", "offload"]


@dataclass
class PagingConfig:
    """Where paged teachers (``training.teacher_residency: paged``) are kept off the device, and how many device
    slots they share (``distill_kit/teachers/paged.py``; docs/teachers.md#paged-routed-teachers)."""

    slots: int = 2
    """Device buffers, each the size of the largest paged teacher: 2 lets the next teacher's transfer overlap the
    current teacher's steps; 1 halves the device memory, and every switch waits for its transfer."""
    host_gib: float = 0.0
    """Pinned host memory (GiB, per rank) for the teachers' copies, filled in the teachers' order; those that do not
    fit are kept on disk_dir. 0: what the host has available, less room to load the largest teacher and 4 GiB."""
    disk_dir: str | None = None
    """Folder for the teachers beyond host_gib (one file each, read back through a small pinned staging buffer);
    None: the system's temporary folder."""

    def __post_init__(self) -> None:
        if self.slots not in (1, 2):
            raise ValueError(f"teacher_paging.slots: {self.slots}; give 1 or 2")
        if not self.host_gib >= 0:
            raise ValueError(f"teacher_paging.host_gib: {self.host_gib}; give 0 (what the host has) or more")


@dataclass
class TrainingConfig:
    """What one optimizer step looks like and how the student learns.

    These are the values a user writes once; every ``"auto"`` in either DeepSpeed config is filled from
    them, so the two engines can never disagree about micro-batch size or precision.
    """

    max_steps: int = 100
    """Optimizer steps to take (each is ``gradient_accumulation_steps`` micro-batches per rank)."""
    micro_batch_size: int = 8
    """Sequences per rank per forward; the teacher engine uses the same."""
    gradient_accumulation_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    """Steps of linear warm-up: step k of them uses lr * k / warmup_steps; 0 or 1 is the full lr at step 1."""
    lr_schedule: LRSchedule = "linear"
    """After warm-up: 'linear' or 'cosine' decay to min_lr_ratio * lr (reached just after the last step), or
    'constant'. The run's, whatever the DeepSpeed config says: the lr of every step is in engines/schedule.py."""
    min_lr_ratio: float = 0.0
    """Where the decay ends, as a fraction of lr; e.g. 0.1 with cosine for a decay to 10%."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    dtype: DType = "fp32"
    """Precision of both engines: bf16 on modern GPUs; fp32 on the CPU, where bf16 matmuls are slow."""
    seed: int = 0
    log_every: int = 10
    checkpoint_dir: str | None = None
    """Where checkpoints go, one ``step_N`` folder each; None writes none (a signal then only stops the run)."""
    save_every: int = 0
    """Optimizer steps between checkpoints; 0 saves only after the last step and when a signal stops the run."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept; the oldest is deleted only once a newer one is complete."""
    max_bad_steps: int = 3
    """Non-finite (NaN/inf loss or gradient) steps in a row that stop the run; fewer are skipped and counted."""
    teacher_kernels: Kernels = "auto"
    """Faster kernels for the teacher (``distill_kit/engines/kernels.py``): liger (Liger-Kernel's RoPE, RMSNorm,
    SwiGLU; ``pip install distill-kit[liger]``), compile (``torch.compile`` per decoder layer), none; auto is liger
    on a GPU where Liger supports the architecture, else none."""
    teacher_precision: Precision = "auto"
    """The teacher's compute precision: auto (the run's dtype), bf16 (only in a bf16 run: the same, by name), or
    fp8: its decoder layers' linear layers in FP8 through torchao (row-wise scales), replicated on every rank
    whatever teacher_ds_config's stage, loaded a layer at a time; a CUDA GPU of compute capability 8.9+
    (``distill_kit/engines/fp8.py``). Its auto teacher_kernels are compile."""
    student_kernels: Kernels = "auto"
    """The same choice for the student(s); auto is none for a student that samples on-policy (Liger's kernels stop
    its compiled decode step's CUDA graphs: ``on_policy.student_kernels``)."""
    fused_loss: bool = True
    """Run the student without its output head and let logit losses apply it chunk by chunk, so the full
    student logits (B x T x vocabulary) never exist (``losses/fused.py``). Used only where it is exact (a ZeRO-2
    student of a known architecture, no loss that reads full logits); the run's log says when it is not."""
    teacher_head_at_loss: bool = True
    """Run an engine teacher without its output head and let logit losses apply it chunk by chunk next to the
    student's, so the teacher's full logits (B x T x vocabulary) never exist either. Used only where it is exact (a
    known architecture, every loss a logit loss that takes it); the run's log says when it is not."""
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    """Rows answered by the student's own samples (GKD) or the teacher's (sequence-level KD); off by default."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Task rewards scored on the student's samples, for a policy_gradient loss (docs/rewards.md); none by default."""
    teacher_residency: Residency = "resident"
    """Where the teachers' weights live. resident: on the device the whole run (ZeRO-3 shards or replicated, by the
    teacher's DeepSpeed config). paged (combine: route): kept in pinned host memory or on disk, each brought onto
    the device for the micro-batches routed to it (teacher_paging). offload: DeepSpeed ZeRO-3 offload_param to
    pinned CPU memory, every layer fetched at every forward (docs/teachers.md#paged-routed-teachers)."""
    teacher_paging: PagingConfig = field(default_factory=PagingConfig)
    """Slots, pinned host budget and disk folder of paged teachers (teacher_residency: paged)."""

    def __post_init__(self) -> None:
        checks = {
            "max_steps": self.max_steps >= 1,
            "micro_batch_size": self.micro_batch_size >= 1,
            "gradient_accumulation_steps": self.gradient_accumulation_steps >= 1,
            "lr": self.lr > 0,
            "warmup_steps": self.warmup_steps >= 0,
            "lr_schedule": self.lr_schedule in ("linear", "cosine", "constant"),
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "max_grad_norm": self.max_grad_norm >= 0,
            "dtype": self.dtype in ("fp32", "bf16", "fp16"),
            "log_every": self.log_every >= 1,
            "save_every": self.save_every >= 0,
            "keep_checkpoints": self.keep_checkpoints >= 1,
            "max_bad_steps": self.max_bad_steps >= 1,
            "teacher_precision": self.teacher_precision in ("auto", "bf16", "fp8"),
            "teacher_residency": self.teacher_residency in ("resident", "paged", "offload"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ValueError(f"invalid training settings: {values}")
        check_seed(self.seed, "training.seed")
        for key in ("teacher_kernels", "student_kernels"):
            check_kernels(getattr(self, key), f"training.{key}")
        check_teacher_precision(self.teacher_precision, self.dtype, "training.teacher_precision", "training.dtype")
        self.betas = tuple(self.betas)
        if isinstance(self.on_policy, dict):
            self.on_policy = OnPolicyConfig(**self.on_policy)
        if isinstance(self.rewards, dict):
            self.rewards = RewardsConfig(**self.rewards)
        group = self.on_policy.samples_per_prompt
        if self.micro_batch_size % group:
            raise ValueError(f"training.on_policy.samples_per_prompt={group} does not divide training.micro_batch_size="
                             f"{self.micro_batch_size}: a micro-batch holds whole groups (micro_batch_size / G prompts "
                             f"x G samples); give a micro_batch_size that is a multiple of {group}")
        if self.rewards.on and (self.on_policy.fraction == 0 or self.on_policy.sampler != "student"):
            raise ValueError("training.rewards score the student's own samples, and this run has none "
                             f"(on_policy.fraction={self.on_policy.fraction}, sampler={self.on_policy.sampler}): set "
                             "training.on_policy.fraction: 1.0 with sampler: student, or drop training.rewards")
        if isinstance(self.teacher_paging, dict):
            self.teacher_paging = PagingConfig(**self.teacher_paging)


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA adapters on a pretrained student (Hu et al. 2021): ``W x + (alpha / r) B A x``, only A and B trained.

    ``r`` and ``alpha`` follow the LoRA paper and ``peft``'s defaults' spirit: a small rank is enough to steer a
    good model, and ``alpha / r`` sets the adapters' scale independently of the rank.
    """

    r: int = 8
    """Rank of each adapter: trained parameters per adapted (d_in x d_out) layer are r * (d_in + d_out)."""
    alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / r) * B A."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0: none, so a step is deterministic given the data)."""
    target_modules: tuple[str, ...] | str = "all-linear"
    """Module names to adapt (e.g. [q_proj, v_proj]), or 'all-linear': every linear layer but the output head."""
    export_merged: bool = False
    """Also export the merged model (base + adapters folded in) to <export>/<name>/merged, which
    AutoModelForCausalLM.from_pretrained loads without peft."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"peft.r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"peft.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("peft.target_modules is empty: name the layers to adapt, or use 'all-linear'")


QuantScheme = Literal["int4_weight_only", "int8_dynamic_act_int4_weight", "fp8", "nvfp4", "mxfp4"]
QUANT_SCHEMES = ("int4_weight_only", "int8_dynamic_act_int4_weight", "fp8", "nvfp4", "mxfp4")


@dataclass(frozen=True)
class QuantizeConfig:
    """A student trained with its decoder layers' linear layers fake-quantised (torchao's quantization-aware
    training) and exported as real low-bit weights (``engines/quantize.py``; docs/quantized_students.md)."""

    scheme: QuantScheme = "int4_weight_only"
    """int4_weight_only (int4 weights, a scale per group of group_size inputs, bf16/fp32 activations: any device),
    int8_dynamic_act_int4_weight (the same weights, and each token's activations in int8: any device), fp8 (e4m3
    weights and activations, a scale per row: a CUDA GPU of compute capability 8.9+), nvfp4 or mxfp4 (4-bit floats
    in blocks of 16 or 32: Blackwell, compute capability 10.0+)."""
    group_size: int = 128
    """Inputs sharing one int4 scale (the int4 schemes): smaller groups follow the weights more closely and store
    more scales. Must divide the input width of every quantised layer (hidden_size, intermediate_size, the
    attention width); nvfp4 and mxfp4 use their formats' own blocks (16, 32)."""
    learn_scales: bool = False
    """The int4 schemes: train each group's scale with the weights (torchao's range learning), starting from PTQ's
    (max |w| / 7.5), and export the learned scales; off, every forward recomputes each scale from its weights."""

    def __post_init__(self) -> None:
        if self.scheme not in QUANT_SCHEMES:
            raise ValueError(f"quantize.scheme: {self.scheme!r} is not one of {', '.join(QUANT_SCHEMES)}")
        if self.group_size < 1:
            raise ValueError(f"quantize.group_size: {self.group_size}; give a whole number >= 1 (e.g. 32, 128)")


@dataclass(frozen=True)
class FeatureDrafterConfig:
    """A drafter that reads its teacher's features (EAGLE-3's design, ``students/feature_drafter.py``): one decoder
    layer of the teacher's class on the fusion of three of its hidden states and the next token's embedding, the
    teacher's embedding table and output head shared and frozen (docs/drafters.md)."""

    layers: tuple[int, ...] | None = None
    """Three indices of the teacher's hidden states (0 the embeddings, i the output of layer i - 1); None takes
    vLLM's and SGLang's EAGLE-3 default, (2, L // 2, L - 3)."""
    ttt_steps: int = 3
    """Draft steps unrolled in training (EAGLE-3's training-time test): step m reads the drafter's own step m - 1
    output where decoding will, its loss weighted 0.8 ** (m - 1) and summed. 1 trains the first draft alone, which
    reads only the teacher's features; from the second draft of a round on, decoding feeds the drafter its own
    (benchmarks/results/drafters.md: the second draft kept 0.43 of the time with 2 steps, 0.11 with 1). Each step
    costs about one more drafter forward over m times the keys; EAGLE-3 trains 7."""

    def __post_init__(self) -> None:
        if not (isinstance(self.ttt_steps, int) and not isinstance(self.ttt_steps, bool) and self.ttt_steps >= 1):
            raise ValueError(f"feature_drafter.ttt_steps: {self.ttt_steps!r}; give the draft steps unrolled in "
                             "training, a whole number >= 1 (e.g. 3, or your serving gamma)")
        if self.layers is not None:
            layers = tuple(self.layers)
            if len(layers) != 3 or not all(isinstance(i, int) and i >= 0 for i in layers):
                raise ValueError(f"feature_drafter.layers: {self.layers!r}; give three indices of the teacher's "
                                 "hidden states (low, middle, high), e.g. [2, 16, 29], or leave it out")
            object.__setattr__(self, "layers", layers)


@dataclass(frozen=True)
class FromTeacherConfig:
    """How a student is cut out of its teacher. Depth: at most one of layers, every, first, last (none keeps every
    layer). Width: any of hidden_size, intermediate_size, num_attention_heads, num_key_value_heads (None keeps
    the teacher's). Sizes are what the student keeps, never more than the teacher has."""

    layers: tuple[int, ...] | None = None
    """Teacher layer indices to keep, in the student's order, e.g. [0, 2, 4, 7]."""
    every: int | None = None
    """Keep layers 0, n, 2n, ...: 2 is DistilBERT's every other layer."""
    first: int | None = None
    """Keep the first k layers."""
    last: int | None = None
    """Keep the last k layers."""
    hidden_size: int | None = None
    """Hidden channels to keep, the most important by activation magnitude (Minitron); None keeps all."""
    intermediate_size: int | None = None
    """MLP neurons to keep in every layer, the most important in each layer; None keeps all."""
    num_attention_heads: int | None = None
    """Query heads to keep in every layer (whole heads; head_dim stays the teacher's); None keeps all."""
    num_key_value_heads: int | None = None
    """Key-value groups to keep under grouped-query attention (each with its query heads); None keeps
    the same fraction of groups as of query heads."""
    calibration_batches: int = 8
    """Training micro-batches the importance is measured on (all ranks run the same ones). Only width pruning
    needs them."""

    def __post_init__(self) -> None:
        depth = [name for name in ("layers", "every", "first", "last") if getattr(self, name) is not None]
        if len(depth) > 1:
            raise ValueError(f"give at most one of layers, every, first, last; got {depth}")
        if self.layers is not None and not self.layers:
            raise ValueError("layers is empty; name at least one teacher layer to keep")
        for name in ("every", "first", "last", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "calibration_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")

    @property
    def prunes_width(self) -> bool:
        return any(v is not None for v in (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                                           self.num_key_value_heads))


@dataclass(frozen=True)
class HarnessConfig:
    """lm-evaluation-harness on each exported student and, once, the teacher, after training
    (``distill_kit/tasks/harness``; docs/run.md#lm-evaluation-harness); empty ``tasks`` runs nothing."""

    tasks: tuple[str, ...] = ()
    """Harness task names: the project's distill_kit_arithmetic and distill_kit_sorting (seeded, local files), or
    any task of the harness (gsm8k, ifeval, mmlu, ...); empty: no harness evaluation."""
    num_fewshot: int | None = None
    """Few-shot examples in each prompt; null: each task's own default."""
    limit: int | None = None
    """Examples per task (the first N); null: all of them."""
    batch_size: int = 16
    """Prompts per forward or generate call of the harness's model."""
    teacher: bool = True
    """Also score the teacher (once, not per student); false for a teacher no single device holds."""
    apply_chat_template: bool | None = None
    """Prompt through each model's chat template; null: where its tokenizer has one (the project's tasks need it)."""
    offline: bool = True
    """No network while the harness runs (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE): models, tasks and data from local
    files and the Hugging Face cache; false lets the harness download a task's data set."""
    examples: int = 500
    """Held-out prompts written for each of the project's tasks (limit takes the first of them)."""
    seed: int = 0
    """Seed of those prompts: the task's held-out stream at this seed (the task benchmark's at the same seed). In a
    task benchmark run, each seed's task.heldout prompts instead (the checker's): leave seed, examples and limit."""

    def __post_init__(self) -> None:
        for key, value, low in (("limit", self.limit, 1), ("num_fewshot", self.num_fewshot, 0),
                                ("batch_size", self.batch_size, 1), ("examples", self.examples, 1)):
            if value is not None and value < low:
                raise ConfigError(f"eval.harness.{key}: {value}; it must be at least {low}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"eval.harness.tasks: {list(self.tasks)} names a task twice; name each once")
        check_seed(self.seed, "eval.harness.seed")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding on held-out prompts, the (first) teacher as target and each student as drafter
    (``distill_kit/training/speculative.py``; docs/drafters.md): tau, the mean tokens a round, the acceptance rate at
    each draft position, and the speed-up predicted from latencies measured on the run's device. Off: prompts 0."""

    prompts: int = 0
    """Held-out rows whose prompts are decoded (the held-out split's first rows, the same on every rank); 0: off."""
    gamma: int = 4
    """Draft tokens a round (num_speculative_tokens in vLLM, speculative-num-draft-tokens - 1 in SGLang)."""
    mode: Literal["greedy", "sampled"] = "greedy"
    """greedy: a draft is kept while it is the teacher's argmax (the output is the teacher's greedy output); sampled:
    modified rejection sampling at temperature (the output's law is the teacher's)."""
    max_new_tokens: int = 32
    """Tokens decoded after each prompt."""
    prompt_tokens: int = 32
    """A text row's first tokens as its prompt; a chat row's prompt is its own (its last prompt_tokens if longer)."""
    temperature: float = 1.0
    """Of both models in sampled mode."""
    seed: int = 0
    """Of the draws in sampled mode: each drafter draws from its own generator with this seed."""

    def __post_init__(self) -> None:
        if self.gamma < 1:
            raise ConfigError(f"eval.speculative.gamma: {self.gamma}; a drafter proposes at least one token a round: "
                              "give 1 or more (4 is usual; vLLM's num_speculative_tokens)")
        for key, low in (("prompts", 0), ("max_new_tokens", 1), ("prompt_tokens", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"eval.speculative.{key}: {getattr(self, key)}; it must be at least {low}")
        if not self.temperature > 0:
            raise ConfigError(f"eval.speculative.temperature: {self.temperature}; give a number > 0 (greedy decoding "
                              "is mode: greedy)")
        check_seed(self.seed, "eval.speculative.seed")

    @property
    def on(self) -> bool:
        return self.prompts > 0


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: perplexity, top-1 agreement with the teacher, mean teacher-student KL."""

    every: int = 0
    """Optimizer steps between evaluations; 0 evaluates only at the end."""
    max_batches: int | None = None
    """Micro-batches per rank per evaluation; None uses the whole held-out split."""
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    """lm-evaluation-harness tasks scored on every exported student and the teacher at the end of the run."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Each student as a speculative-decoding drafter of the teacher, at every evaluation: tau and the predicted
    speed-up (docs/drafters.md); off unless prompts > 0."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every: {self.every} steps; give 0 (evaluate at the end only) or more")
        if self.max_batches is not None and self.max_batches < 1:
            raise ConfigError(f"eval.max_batches: {self.max_batches} batches would evaluate nothing (every figure of "
                              "the report over no token); give 1 or more, or null for the whole held-out split")


# The default rows: the ceiling, the baseline, and the two recipes that learn the task (docs/tasks.md); the rest
# run with task.recipes. Four rows at three seeds fit the seeded table's 20 minutes on a 2-core CPU.
RECIPES = ("teacher", "sft", "seq_kd", "on_policy_forward_kl")
EXTRA_RECIPES = ("forward_kl", "on_policy_reverse_kl", "on_policy_jsd", "mixed", "self_distill", "grpo", "opd",
                 "opd_reward", "fixed_advantage")


@dataclass(frozen=True)
class TaskConfig:
    """With ``name`` set, ``scripts/distill.py`` runs the task's comparison (``distill_kit/run/task_benchmark.py``):
    every recipe from the first student's initial weights and ``training.max_steps`` steps, then greedy
    exact-match accuracy on held-out prompts, at every seed of ``seeds``, into report.json."""

    name: Literal["arithmetic", "sorting"] | None = None
    """The task (arithmetic: running sums; sorting: eight digits in order); None trains the students on ``data`` as
    usual. Its teacher: distill_kit/assets/<name>/teacher."""
    labelled: int = 300
    """Prompts with reference answers: all SFT and off-policy KD see (distillation helps most where answers are few)."""
    prompts: int = 20000
    """Prompts without answers: what sequence-level KD and on-policy distillation learn from (the teacher answers)."""
    heldout: int = 500
    """Held-out prompts for greedy exact-match accuracy and the teacher-student KL on their answers."""
    warm_start_steps: int = 100
    """SFT steps on the labelled answers before the on-policy recipes (part of their max_steps): a random student's
    samples are noise the teacher cannot correct (GKD; on-policy from scratch: docs/tasks.md)."""
    recipes: tuple[str, ...] = RECIPES
    """Which rows to run: by default teacher, sft, seq_kd and on_policy_forward_kl; also forward_kl,
    on_policy_reverse_kl, on_policy_jsd, mixed and self_distill (the student its own teacher, the labelled answers
    in its prompt; how they compare: docs/tasks.md), and with the task's checker as reward grpo, opd, opd_reward
    and fixed_advantage (docs/rewards.md#the-recipes)."""
    policy_lr: float = 3.0e-4
    """training.lr of the reward recipes (grpo, opd, opd_reward, fixed_advantage): a policy gradient's updates come
    from sampled advantages, noisy where a divergence's gradient is not, and at the SFT recipes' 3e-3 Adam's
    normalised steps wrecked the warm start within ten steps (sorting: reward 0.80 to 0.0; at 3e-4 and 3e-5 it
    held: benchmarks/results/rewards.md). RL fine-tuning runs a smaller lr than SFT for the same reason."""
    reward_weight: float = 1.0
    """The reward advantage's weight in opd_reward (its teacher's is 1): the sequence's group-normalised reward, the
    same at every token, against the teacher's per-token advantage (docs/rewards.md#the-objective)."""
    samples_per_prompt: int = 4
    """G of the reward recipes (grpo, opd, opd_reward, fixed_advantage): samples of each prompt per group;
    training.micro_batch_size counts the samples, so every on-policy recipe samples as many rows per step."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Each recipe runs once per seed, as training.seed (its data draw, initial student, batch order and sampling);
    the table gives the mean exact match, its range and each seed's value. [0]: the one-seed quick mode."""
    max_new_tokens: int = 32
    """Longest answer sampled in training or generated in evaluation (the task's answers are 27 tokens)."""

    def __post_init__(self) -> None:
        unknown = [r for r in self.recipes if r not in RECIPES + EXTRA_RECIPES]
        if unknown:
            raise ValueError(f"task.recipes: unknown {unknown}; choose from {list(RECIPES + EXTRA_RECIPES)}")
        if min(self.labelled, self.prompts, self.heldout) < 1 or self.warm_start_steps < 0:
            raise ValueError("task.labelled, task.prompts and task.heldout must be >= 1, warm_start_steps >= 0")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"task.seeds: {list(self.seeds)}; give one or more distinct seeds, e.g. [0, 1, 2] (or "
                             "[0] for one quick run)")
        for i, seed in enumerate(self.seeds):
            check_seed(seed, f"task.seeds[{i}]")
        if not (self.reward_weight >= 0 and math.isfinite(self.reward_weight)):
            raise ValueError(f"task.reward_weight: {self.reward_weight}; give a finite number >= 0")
        if not self.policy_lr > 0:
            raise ValueError(f"task.policy_lr: {self.policy_lr} is not a learning rate; give a number > 0")
        if self.samples_per_prompt < 1:
            raise ValueError(f"task.samples_per_prompt: {self.samples_per_prompt}; give 1 or more (4: GRPO's groups)")
        if self.max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens: {self.max_new_tokens} tokens leaves no answer to sample or "
                             "generate; give 1 or more (the task's answers are 27 tokens)")


def import_subclass(path: str, base: type, key: str, fix: str) -> type:
    """``pkg.module:Class``, which must subclass ``base``: what a run config names by import path (a Distiller, a
    teacher). One ``ConfigError`` naming ``key`` for every way it can fail (no such module or class, the module's
    own error, another class), ``fix`` saying what the class must be."""
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name:
        raise ConfigError(f"{key}: {path!r} is not an import path; write 'pkg.module:Class'")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except Exception as err:  # noqa: BLE001 - a missing module, a typo, or the module's own error (a SyntaxError)
        raise ConfigError(f"{key}: cannot import {path!r} ({type(err).__name__}: {err}); check the module is on "
                          "PYTHONPATH, imports cleanly, and the class is spelled as in its file") from None
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ConfigError(f"{key}: {path!r} is not a subclass of {base.__module__}.{base.__name__}; {fix}")
    return found


def _check_name(name: Any, kind: str) -> None:
    if not (isinstance(name, str) and name and name.replace("-", "_").replace(".", "_").isidentifier()):
        raise ValueError(f"{kind} name {name!r} must be a non-empty word (letters, digits, '_', '-', '.'): it names "
                         "the model's log keys and its folders")


@dataclass(frozen=True)
class StudentSpec:
    """One trained model: where it comes from, what it learns from, and its own optimizer settings.

    Everything that shapes a batch (micro-batch, accumulation, steps, precision) is the run's
    :class:`TrainingConfig`, because every model steps on the same micro-batches; what an optimizer does with them
    is the model's own.
    """

    name: str = "student"
    """Label in logs (``<name>/loss``), the report, and the folder of its checkpoints and export (``<dir>/<name>``)."""
    model: str | None = None
    """A save_pretrained directory or hub name (in Python also a built ``nn.Module``). None: the run builds a
    fresh model from the teacher's config with ``init`` overrides (random weights), or cuts it from the teacher
    (``init_from_teacher``)."""
    loss: Any = "forward_kl"
    """A registered loss name, {name: ..., params}, a list of {name, weight} for a weighted sum, or
    'pkg.module:Class'."""
    lr: float | None = None
    """Its learning rate (fills its "auto" lr and warm-up peak); None takes training.lr."""
    ds_config: str | None = None
    """Its DeepSpeed config (JSON/HJSON, "auto" allowed); None takes the run's student_ds_config."""
    ds_overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted DeepSpeed keys for this student only, over student_ds_overrides, e.g. {zero_optimization.stage: 3}."""
    peft: AdapterConfig | None = None
    """LoRA adapters {r, alpha, dropout, target_modules, export_merged} trained on a frozen student (needs the
    peft extra and a ZeRO-0/1/2 student); None trains every weight. Python also takes a ``peft.PeftConfig``."""
    init: dict[str, Any] = field(default_factory=dict)
    """Config overrides applied to the teacher's config to build a fresh student, e.g. {num_hidden_layers: 2}."""
    init_from_teacher: FromTeacherConfig | None = None
    """Build the student from the teacher's own weights instead: kept layers (DistilBERT) and width pruned by
    activation importance (Minitron); Llama and Qwen2 teachers. Not with model or init."""
    feature_drafter: FeatureDrafterConfig | None = None
    """Build the student as a drafter that reads the teacher's hidden states (EAGLE-3's one layer, sharing the
    teacher's embedding and head; docs/drafters.md), e.g. {} for the default layers. Not with model, init,
    init_from_teacher, peft or quantize."""
    quantize: QuantizeConfig | None = None
    """Train the student fake-quantised in a low-bit scheme {scheme, group_size} and export it as real low-bit
    weights (quantization-aware distillation; docs/quantized_students.md); None trains and exports it as it is."""

    def __post_init__(self) -> None:
        _check_name(self.name, "student")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"students[{self.name}].lr: {self.lr} is not a learning rate; give a number > 0 (e.g. "
                              "3e-4), or leave it out to take training.lr")
        if self.init_from_teacher is not None and (self.model is not None or self.init):
            raise ValueError("init_from_teacher builds the student itself; drop model and init from this student "
                             "(the sizes go in init_from_teacher: hidden_size, intermediate_size, ...)")
        if isinstance(self.feature_drafter, Mapping):
            object.__setattr__(self, "feature_drafter", build(FeatureDrafterConfig, self.feature_drafter,
                                                              "feature_drafter."))
        if self.feature_drafter is not None:
            others = [name for name in ("model", "init", "init_from_teacher", "peft", "quantize")
                      if getattr(self, name)]
            if others:
                raise ValueError(f"students[{self.name}].feature_drafter builds the student on its teacher; drop "
                                 f"{', '.join(others)} from this student")
        if isinstance(self.peft, Mapping):
            object.__setattr__(self, "peft", build(AdapterConfig, self.peft, "peft."))
        if isinstance(self.quantize, Mapping):
            object.__setattr__(self, "quantize", build(QuantizeConfig, self.quantize, "quantize."))
        if isinstance(self.init_from_teacher, Mapping):
            object.__setattr__(self, "init_from_teacher", build(FromTeacherConfig, self.init_from_teacher,
                                                                "init_from_teacher."))

    def training(self, run: TrainingConfig) -> TrainingConfig:
        """The run's settings with this model's own learning rate."""
        return run if self.lr is None else dataclasses.replace(run, lr=self.lr)


@dataclass(frozen=True)
class TeacherSpec:
    """One frozen teacher: where its outputs come from (``kind``), its weight, and its engine's settings.

    ``kind`` picks the backend (``distill_kit/teachers/``): an in-process engine of a model folder, a captured store,
    or a class of your own. ``auto`` reads it from ``model``: a folder holding a store's ``manifest.json`` is a
    store, ``pkg.module:Class`` is that class, anything else a model (folder, hub name or ``nn.Module``)."""

    name: str = "teacher"
    """Label in logs (``<student>/<name>``), the report and the checkpoints' record of teacher identities."""
    model: Any = None
    """A save_pretrained directory or hub name, a store folder (``scripts/capture_teacher.py``), or
    ``pkg.module:Class`` (a :class:`distill_kit.teachers.Teacher` subclass); in Python also a built ``nn.Module``.
    With several teachers each must use the student's tokenizer (logits are compared id by id)."""
    kind: str = "auto"
    """The backend: auto (read from model), engine, store, served, self (the student itself reading a privileged
    prompt: no model; docs/teachers.md#the-student-as-its-own-teacher), or pkg.module:Class (model is handed to it)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The backend's own settings, e.g. a store's {tail_bucket: false}; each backend names the ones it takes."""
    weight: float = 1.0
    """Its weight in the sum of losses, or its share of the mixture (normalised there); >= 0, one of them > 0."""
    ds_config: str | None = None
    """Its DeepSpeed config; None takes the run's teacher_ds_config."""
    ds_overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted DeepSpeed keys for this teacher only, over teacher_ds_overrides."""

    def __post_init__(self) -> None:
        _check_name(self.name, "teacher")
        if self.model is None and ":" not in self.kind and self.kind != "self":  # a self-teacher is the student
            raise ValueError(f"teacher {self.name!r} has no model: give model: path/to/teacher")
        if not (isinstance(self.weight, int | float) and not isinstance(self.weight, bool)
                and math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError(f"teacher {self.name!r}: weight must be a finite number >= 0, got {self.weight!r}")


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The run's DeepSpeed configs as one value: the students' and the teachers' (files, JSON/HJSON with "auto", or
    dicts) and the dotted keys written over each. A spec's own ``ds_config`` / ``ds_overrides`` go over these."""

    student: Any = str(CONFIG_DIR / "zero2_student.json")
    """Every student's DeepSpeed config, unless its spec names its own."""
    teacher: Any = str(CONFIG_DIR / "zero3_teacher.json")
    """Every engine teacher's, unless its spec names its own; ZeRO-3 shards it, stage 0 replicates it."""
    student_overrides: dict[str, Any] = field(default_factory=dict)
    teacher_overrides: dict[str, Any] = field(default_factory=dict)


def specs(cls: type, entries: Sequence[Any], kind: str) -> list[Any]:
    """``entries`` (specs or plain dicts) as a list of ``cls`` with distinct names; dicts go through :func:`build`."""
    built = [build(cls, entry, f"{kind}s[{i}].") if isinstance(entry, Mapping) else entry
             for i, entry in enumerate(entries)]
    check_names(built, kind)
    return built


def check_names(built: Sequence[Any], kind: str) -> None:
    """Specs of one kind have distinct names: a name names its folder, log keys and report row."""
    names = [spec.name for spec in built]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"{kind}s: the names {repeated} are given more than once; each {kind} needs its own "
                          "name (it names its folder, log keys and report row)")


# ---- dicts <-> dataclasses ---

def field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass, by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _plain(value: Any) -> Any:
    """Dataclasses, tuples and paths as YAML-friendly dicts, lists and strings."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def _convert(value: Any, tp: Any, key: str) -> Any:
    """``value`` (from YAML or a command-line string) as type ``tp``, or a ConfigError naming ``key``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin is tuple:
        items = _safe_load(value, key) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(items))
        if len(items) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(items)}")
        return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(items, args, strict=True)))
    if origin in (dict, Mapping) or tp is dict:
        parsed = _safe_load(value, key) if isinstance(value, str) else value
        if not isinstance(parsed, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(parsed)
    if origin in (list, Sequence):
        parsed = _safe_load(value, key) if isinstance(value, str) else value
        return list(parsed) if isinstance(parsed, (list, tuple)) else [parsed]
    if _is_dataclass_type(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, f"{key}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
        if tp is int and isinstance(value, int):
            return value
        if tp is int and isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value)  # exactly, even beyond a float's precision
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}") from None
        if not math.isfinite(number):  # no setting means anything at inf or NaN; they would only fail later
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        if tp is float:
            return number
        if number != int(number):  # 1.05e1 is not an integer, and must not quietly become 10
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(number)
    if tp is str:
        if isinstance(value, (Mapping, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def build(cls: type, values: Mapping[str, Any], prefix: str = "") -> Any:
    """A dataclass from a (possibly partial) mapping; unknown keys are errors with the closest valid key."""
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{prefix}{key}': {hint}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(value, hints[name], f"{prefix}{name}") for name, value in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise  # already names its key
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {err}") from err


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line, with the line and column it points at (1-based, as editors count)."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(getattr(err, "problem", None) or err).split())


def _safe_load(text: str, key: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: cannot read {text!r} as YAML ({_yaml_problem(err)})") from None
