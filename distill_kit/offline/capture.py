"""Run the (ZeRO-3 sharded) teacher over a dataset once and write its top-k outputs to a store.

Every rank runs the teacher on its own micro-batches (``data.BlockLoader``: the same number on every rank,
as the ZeRO-3 forward's collectives need) and writes its own parts; nothing is gathered. A part covers
``batches_per_part`` micro-batches and is written whole or not at all, so a capture that stops resumes
at the last part every rank finished, and a part written twice is written with the same content.

:func:`capture` runs an in-process engine; :func:`fill_store` is the loop and the store around any source of rows,
so a served teacher fills the same store through its client (``teachers/served_capture.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from distill_kit.config import (
    CONFIG_DIR,
    DeepSpeedSettings,
    Precision,
    TeacherSpec,
    TrainingConfig,
    check_teacher_precision,
)
from distill_kit.data.blocks import BlockLoader
from distill_kit.engines import distributed, fingerprint, fp8, kernels, models
from distill_kit.engines.build import build_teacher
from distill_kit.engines.deepspeed_config import FrozenConfig, prepare
from distill_kit.engines.models import ModelSource
from distill_kit.errors import ConfigError
from distill_kit.offline.fingerprints import dataset_fingerprint, tokenizer_fingerprint
from distill_kit.offline.store import (
    MANIFEST,
    Manifest,
    PartWriter,
    StoreSpec,
    block_key,
    completed_batches,
    store_stats,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureConfig:
    """What to keep per token, and how the capture is cut into work."""

    k: int = 64
    """Most likely next tokens kept per position; 64 holds nearly all of an LLM's mass at temperature 1."""
    values_dtype: str = "fp16"
    """Of the log-probabilities: fp16 is 8x more precise than bf16 over their range, at the same size."""
    hidden_layers: tuple[int, ...] = ()
    """Hidden states to keep (0 = embeddings, L = last); each costs 2 x hidden_size bytes a token."""
    hidden_dtype: str = "bf16"
    """Of the hidden states: bf16, whose range holds large activations that overflow fp16."""
    micro_batch_size: int = 8
    batches_per_part: int = 64
    """Micro-batches per part file: the unit a stopped capture loses, and one file's size."""
    dtype: str = "bf16"
    """The precision of the teacher's embeddings, norms and head, and of its matmuls unless teacher_precision says
    otherwise."""
    teacher_precision: Precision = "auto"
    """fp8: the teacher's decoder layers in FP8, replicated and compiled per layer (``engines/fp8.py``)."""
    chunk_tokens: int = 2048
    """Rows of logits turned into float32 log-probabilities at a time: bounds memory at large vocabularies."""
    targets: str = "top_k"
    """``top_k``: the k most likely tokens and the tail. ``sampled``: k tokens drawn from the teacher's distribution
    at ``temperature`` (RS-KD), for forward KL's unbiased estimate (``offline/store.py``)."""
    temperature: float = 1.0
    """A sampled store's: the temperature the tokens are drawn at; the training loss's must be the same."""

    def __post_init__(self) -> None:
        for name in ("k", "micro_batch_size", "batches_per_part", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"capture {name} must be >= 1, got {getattr(self, name)}")
        if self.targets not in ("top_k", "sampled"):
            raise ValueError(f"capture targets must be top_k or sampled, got {self.targets!r}")
        if self.targets == "sampled" and self.k > 255:
            raise ValueError(f"capture k must be <= 255 for a sampled store (counts are uint8), got {self.k}")
        if not self.temperature > 0:
            raise ValueError(f"capture temperature must be > 0, got {self.temperature}")
        if self.targets == "top_k" and self.temperature != 1.0:
            raise ValueError(f"capture temperature {self.temperature}: a top-k store keeps log-probabilities at "
                             "temperature 1 (any loss temperature is applied to them); temperature is a sampled "
                             "store's (--targets sampled)")
        if self.teacher_precision not in ("auto", "bf16", "fp8"):
            raise ValueError(f"capture teacher_precision must be auto, bf16 or fp8, got {self.teacher_precision!r}")
        check_teacher_precision(self.teacher_precision, self.dtype, "capture teacher_precision", "dtype")

    def training(self) -> TrainingConfig:
        """The run settings the teacher's engine follows, as a run's teacher follows the run's: batch and precision."""
        return TrainingConfig(micro_batch_size=self.micro_batch_size, dtype=self.dtype)


Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]
"""A micro-batch's store rows, one per real token of its dataset blocks, in order: top-k log-probabilities (n, k)
float32, their ids (n, k), the tail's log mass (n,) (a sampled store: the counts (n, k)), and each kept hidden layer's
states (n, H)."""


def top_k(logits: torch.Tensor, k: int, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits`` (n, V) -> top-k log-probabilities (n, k) float32, ids (n, k), log of the rest (n,).

    The tail is a logsumexp over the other tokens' log-probabilities, not ``log(1 - sum)``: a tail below
    float32's resolution of 1 stays exact. With k = V it is log 0 = -inf.
    """
    values, ids, tails = [], [], []
    for chunk in logits.split(chunk_tokens):
        log_p = F.log_softmax(chunk.float(), dim=-1)
        top_values, top_ids = log_p.topk(k, dim=-1)
        tails.append(log_p.scatter_(-1, top_ids, float("-inf")).logsumexp(-1))
        values.append(top_values)
        ids.append(top_ids)
    return torch.cat(values), torch.cat(ids), torch.cat(tails)


def sample(logits: torch.Tensor, k: int, temperature: float, generator: torch.Generator | None,
           chunk_tokens: int = 2048) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k`` tokens drawn (with replacement) from ``softmax(logits / temperature)`` per row: ``logits`` (n, V) ->
    their log-probabilities at that temperature (n, k) (float32, or float64 for float64 logits), the distinct ids
    (n, k) int64, most drawn order not kept (ascending id), and how often each was drawn (n, k) int64 summing to
    ``k``; unused slots (fewer distinct ids than draws) hold id 0, count 0 and log-probability 0."""
    values, ids, counts = [], [], []
    for chunk in logits.split(chunk_tokens):
        log_p = F.log_softmax(chunk.to(torch.promote_types(chunk.dtype, torch.float32)) / temperature, dim=-1)
        drawn = torch.multinomial(log_p.exp(), k, replacement=True, generator=generator).sort(-1).values
        first = torch.ones_like(drawn, dtype=torch.bool)
        first[:, 1:] = drawn[:, 1:] != drawn[:, :-1]
        slot = first.cumsum(-1) - 1  # the slot of each draw: its distinct id's rank
        distinct = torch.zeros_like(drawn).scatter_(-1, slot, drawn)
        count = torch.zeros_like(drawn).scatter_add_(-1, slot, torch.ones_like(drawn))
        values.append(log_p.gather(-1, distinct).masked_fill(count == 0, 0.0))
        ids.append(distinct)
        counts.append(count)
    return torch.cat(values), torch.cat(ids), torch.cat(counts)


def batch_generator(input_ids: torch.Tensor, device: torch.device) -> torch.Generator:
    """A generator seeded by a micro-batch's tokens: the same draws for the same batch, on any rank and on a resumed
    capture (a part written twice is written with the same content)."""
    import hashlib

    digest = hashlib.blake2b(input_ids.to(torch.int64).cpu().numpy().tobytes(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def targets_of(logits: torch.Tensor, input_ids: torch.Tensor, config: CaptureConfig
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A store's rows of ``logits`` (n, V): top-k (values, ids, tails) or, sampled, (log-probabilities, ids, counts),
    the draws seeded by ``input_ids`` (the micro-batch's)."""
    if config.targets == "sampled":
        return sample(logits, config.k, config.temperature,
                      batch_generator(input_ids, logits.device), config.chunk_tokens)
    return top_k(logits, config.k, config.chunk_tokens)


def engine_config(teacher: ModelSource, config: CaptureConfig, world_size: int,
                  ds_config: str | Path | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The teacher engine's DeepSpeed config (None: a run's default teacher config), filled and checked by the code
    that fills a run's teachers' (``FrozenConfig.of`` and ``prepare``, as ``training/plan.make_plan`` calls them): the
    plan's config for the same teacher and settings, and a bad one refused in the plan's words
    (``DeepSpeedConfigError``), before anything loads."""
    spec = TeacherSpec(model=teacher, ds_config=ds_config)
    _, teachers = prepare({}, {spec.name: FrozenConfig.of(spec, models.hidden_size(teacher), DeepSpeedSettings())},
                          world_size=world_size, training=config.training())
    return teachers[spec.name]


def _on_main(compute: Callable[[], str]) -> str:
    """``compute()`` on rank 0 only (e.g. hashing a large dataset), its result sent to every rank."""
    return distributed.broadcast_object(compute() if distributed.is_main() else None)


FLAGS = {"teacher": "--teacher", "teacher_hash": "--teacher's weights", "teacher_config": "--teacher's config",
         "tokenizer": "--tokenizer", "tokenizer_hash": "--tokenizer's vocabulary",
         "dataset": "the blocks: --data, --heldout, --split, --block-size, --max-blocks, ...", "k": "--k",
         "values_dtype": "--values-dtype", "hidden_layers": "--hidden-layers", "hidden_dtype": "--hidden-dtype",
         "targets": "--targets", "temperature": "--temperature",
         "world_size": "the number of ranks", "micro_batch_size": "--micro-batch-size",
         "batches_per_part": "--batches-per-part"}
"""What sets each field of a store's manifest (``scripts/capture_teacher.py``'s flags), for the refusals' fixes."""


def out_problem(root: str | Path, given: Mapping[str, Any]) -> str | None:
    """Why the folder ``root`` cannot take this capture, or None: it is new, empty, or a store started with the same
    ``given`` manifest fields (any of :data:`FLAGS`' names; the ones not known yet left out), which is resumed.

    Refused: a file; a folder of other files (not a store: a capture never writes among a user's files); a store of
    another format, or started with other arguments (each difference named, with the flag that sets it)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        return (f"{root} is a file, not a folder: give --out a new folder (or a store's folder, to resume its "
                "capture)")
    if not root.exists():
        return None
    if not (root / MANIFEST).exists():
        entries = sorted(p.name for p in root.iterdir())
        if not entries:
            return None
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        return (f"{root} is not a teacher store (no {MANIFEST}) and holds other files ({shown}); a capture will not "
                "write into it: give --out a new or empty folder")
    try:
        found = Manifest.load(root)
    except (ConfigError, OSError) as err:
        return f"{err}; a capture will not write into it: give --out a new or empty folder"
    differences = [_difference(name, _field(found, name), value) for name, value in given.items()
                   if _field(found, name) != value]
    if not differences:
        return None
    return (f"{root} holds a teacher store started with other arguments, so this capture cannot resume it:\n  - "
            + "\n  - ".join(differences) + "\nGive --out another folder for these arguments, or the arguments the "
            "store was started with to resume it.")


def _field(manifest: Manifest, name: str) -> Any:
    return getattr(manifest, name) if name in ("world_size", "micro_batch_size", "batches_per_part") else getattr(
        manifest.spec, name)


def _difference(name: str, stored: Any, now: Any) -> str:
    """One line: the field, the store's value and this capture's, and the flag that sets it."""
    if isinstance(stored, dict) and isinstance(now, dict):  # a model config: only the keys that differ
        keys = sorted(k for k in stored.keys() | now.keys() if stored.get(k) != now.get(k))
        stored, now = ({k: side.get(k) for k in keys[:4]} for side in (stored, now))
    elif isinstance(stored, tuple) or isinstance(now, tuple):
        stored, now = list(stored), list(now)
    return f"{name}: store {stored!r}, now {now!r} ({FLAGS.get(name, name)})"


def start(root: Path, spec: StoreSpec, config: CaptureConfig) -> Manifest:
    """Create the store, or check that the one there was started with this spec and layout (resume); a folder that
    is not a store (or is another) is refused (:func:`out_problem`), decided on the main rank, before any write."""
    manifest = Manifest(spec, distributed.world_size(), config.micro_batch_size, config.batches_per_part)
    given = vars(spec) | {name: getattr(manifest, name) for name in ("world_size", "micro_batch_size",
                                                                      "batches_per_part")}
    problem = _on_main(lambda: out_problem(root, given) or "")
    if problem:
        raise ConfigError(problem)
    if distributed.is_main() and not (root / MANIFEST).exists():
        root.mkdir(parents=True, exist_ok=True)
        manifest.save(root)
    distributed.barrier()
    return Manifest.load(root)


def capture(teacher: ModelSource, tokenizer: Any, blocks: datasets.Dataset, out: str | Path,
            config: CaptureConfig | None = None, *,
            ds_config: str | Path | Mapping[str, Any] = CONFIG_DIR / "zero3_teacher.json") -> Manifest:
    """Capture ``teacher`` over ``blocks`` (``data.tokenize_to_blocks`` output) into the store ``out``.

    ``tokenizer`` None records none (data that are token ids only, e.g. a benchmark's random ones).

    Run on every rank (``torchrun``/``deepspeed``, or plain ``python`` for one). Returns the finished
    manifest, whose ``stats`` hold tokens and bytes per token on disk.
    """
    config = config or CaptureConfig()
    device = distributed.init()
    teacher_cfg = models.model_config(teacher)
    ds = engine_config(teacher, config, distributed.world_size(), ds_config)
    precision = fp8.resolve(config.teacher_precision, config.dtype)
    fp8.check_teacher(precision, config.dtype, teacher, "teacher_precision")
    loaded = fp8.load_teacher(teacher, ds, config.dtype, precision, False, device)
    if precision == "fp8":
        kernels.apply(loaded, "compile", "teacher_precision")  # FP8 pays off only fused (engines/fp8.py)
    model = build_teacher(loaded, ds, config.dtype, device)

    @torch.no_grad()
    def rows(batch: Mapping[str, torch.Tensor], real: int) -> Rows:
        """The teacher's forward on the whole micro-batch (a collective: filler rows too), then its first ``real``
        blocks' rows."""
        input_ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        out = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=bool(config.hidden_layers),
                    use_cache=False)  # no cache: see training/student.py:Student.inputs
        keep = mask[:real].bool()
        values, ids, tails = (t.cpu() for t in targets_of(out.logits[:real][keep], input_ids[:real], config))
        return values, ids, tails, {layer: out.hidden_states[layer][:real][keep].cpu()
                                    for layer in config.hidden_layers}

    name = type(teacher).__name__ if isinstance(teacher, torch.nn.Module) else str(teacher)
    # The identity checkpoints record too, so a run resumed from the store is checked against the same teacher.
    return fill_store(rows, name, fingerprint.teacher_fingerprint(model), teacher_cfg.to_dict(), tokenizer, blocks,
                      out, config)


def fill_store(rows: Callable[[Mapping[str, torch.Tensor], int], Rows], teacher: str, teacher_hash: str,
               teacher_config: Mapping[str, Any], tokenizer: Any, blocks: datasets.Dataset, out: str | Path,
               config: CaptureConfig) -> Manifest:
    """The store ``out`` filled with ``rows(batch, real)`` of each of this rank's micro-batches of ``blocks`` (its
    first ``real`` rows are dataset blocks, the rest the loader's filler), resumed where a stopped capture ended.

    ``teacher``, ``teacher_hash`` and ``teacher_config`` are what the manifest records of the teacher (its source,
    its weights' sha256, its config as a dict); ``tokenizer`` None records none. Nothing is written before this
    call: a source checks what it can serve first."""
    root = Path(out)
    device = distributed.init()
    rank, world = distributed.rank(), distributed.world_size()
    spec = StoreSpec(
        teacher=teacher, teacher_hash=teacher_hash, teacher_config=dict(teacher_config),
        tokenizer="none" if tokenizer is None else str(getattr(tokenizer, "name_or_path", "?")),
        tokenizer_hash="" if tokenizer is None else tokenizer_fingerprint(tokenizer),
        dataset=_on_main(lambda: dataset_fingerprint(blocks)),
        k=config.k, values_dtype=config.values_dtype,
        hidden_layers=config.hidden_layers, hidden_dtype=config.hidden_dtype,
        targets=config.targets, temperature=float(config.temperature),
    )
    manifest = start(root, spec, config)
    loader = BlockLoader(blocks, config.micro_batch_size, rank=rank, world_size=world, shuffle=False,
                         drop_last=False)
    # Every rank resumes at the same micro-batch (the teacher's forward is collective): the least any finished.
    done = torch.tensor(completed_batches(root, rank), device=device)
    if world > 1:
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
    done = int(done)  # a part boundary: every rank's parts end at the same micro-batches
    loader.load_state_dict({"epoch": 0, "index": done})
    writer = PartWriter(root, rank, spec)
    progress = tqdm(total=len(loader), initial=done, desc="capturing", disable=not distributed.is_main())
    first, started = done, time.perf_counter()
    for index, batch in enumerate(loader, start=done):
        real = _real_blocks(len(blocks), index, rank, world, config.micro_batch_size)
        _write_rows(writer, batch, real, *rows(batch, real))
        if (index + 1) % config.batches_per_part == 0 or index + 1 == len(loader):
            writer.flush(first, index + 1)
            first = index + 1
        progress.update(1)
    progress.close()
    distributed.barrier()
    if distributed.is_main():
        manifest.complete = True
        manifest.stats = store_stats(root, spec) | {"capture_s": time.perf_counter() - started}
        manifest.save(root)
        logger.info("teacher store %s: %s", root, manifest.stats)
    distributed.barrier()
    return Manifest.load(root)


def _real_blocks(num_blocks: int, index: int, rank: int, world: int, micro_batch_size: int) -> int:
    """How many rows of this micro-batch are dataset blocks; the rest are the loader's filler (no labels)."""
    start = (index * world + rank) * micro_batch_size
    return max(0, min(micro_batch_size, num_blocks - start))


def _write_rows(writer: PartWriter, batch: Mapping[str, torch.Tensor], real: int, values: torch.Tensor,
               ids: torch.Tensor, tails: torch.Tensor, hidden: Mapping[int, torch.Tensor]) -> None:
    """A micro-batch's :data:`Rows` split into its first ``real`` blocks, each added under its tokens' key."""
    input_ids, keep = batch["input_ids"][:real], batch["attention_mask"][:real].bool()
    counts = keep.sum(1).tolist()
    hidden_rows = {layer: state.split(counts) for layer, state in hidden.items()}
    for row, (row_values, row_ids, row_tails) in enumerate(zip(values.split(counts), ids.split(counts),
                                                              tails.split(counts), strict=True)):
        writer.add(block_key(input_ids[row], keep[row]), row_values, row_ids, row_tails,
                   {layer: rows[row] for layer, rows in hidden_rows.items()})
