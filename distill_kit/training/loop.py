"""The training loop, written once: for the Distiller (one student) and for groups of models stepping together.

A trainer supplies its models and one micro-batch of their work, each by name::

    engines()            -> {name: DeepSpeed engine}
    micro_batch(batch)   -> {name: LossOutput}        # forwards, losses, backwards, engine steps

and :class:`Trainer` does everything around them: gradient accumulation and the step's token normaliser, one log
record per optimizer step (each part the mean over the step's micro-batches and all ranks), non-finite steps
(``nonfinite.py``), a checkpoint every ``training.save_every`` steps and exact resume (``checkpoint.py``: every
engine, the step, the history, each rank's random generators and data position), and SIGTERM/SIGINT
(``preemption.py``).

The :class:`~distill_kit.distiller.Distiller` is the one trainer. Its one-line case's model has the empty name:
its records read ``step, loss, <part>, lr, skipped_steps`` and its checkpoint keeps the engine in
``step_N/deepspeed``. Named models (``students=[...]``) are recorded as ``<name>/loss, <name>/<part>, <name>/lr``,
and a checkpoint keeps each engine in ``step_N/<name>``, next to one manifest and the state the models share (step,
history, random generators, data).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from distill_kit.config import TrainingConfig
from distill_kit.engines import distributed, schedule
from distill_kit.errors import StepFault
from distill_kit.training import checkpoint, nonfinite, preemption
from losses import LossOutput
from losses.base import valid_positions

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


class Trainer:
    """The loop and the run's state (what a checkpoint keeps beyond the engines), around named engines."""

    def __init__(self, training: TrainingConfig | None):
        self.training = training or TrainingConfig()
        self.device = distributed.init()
        transformers.set_seed(self.training.seed)
        self.step = 0  # optimizer steps taken; the same for every model
        self.history: list[dict[str, float]] = []  # every step's record; restored on resume, so the logs continue
        self.micro_batches_seen = 0  # this rank's position in data that keeps none of its own
        self.nonfinite = nonfinite.NonFiniteSteps(self.training.max_bad_steps,
                                                  loss_scaling=self.training.dtype == "fp16")
        self.stopped_by: str | None = None  # the signal that ended the last train() early, if one did
        self.stop_error: StepFault | None = None  # a teacher's or a reward's failure that stopped it (CLI: exit 1)
        self.on_record: Callable[[dict[str, float]], None] | None = None  # called with each step's record
        self.evaluations: list[dict[str, Any]] = []  # every evaluation train() ran, by step; kept by checkpoints
        self.on_evaluation: Callable[[dict[str, Any]], None] | None = None  # called with each evaluation
        self._rewound: dict[str, Any] | None = None  # the position of a step a teacher could not finish
        self.upcoming: Batch | None = None  # the next micro-batch while one is trained (teachers may prefetch)
        self._ahead: tuple[Batch, Any] | None = None  # a micro-batch read ahead, and its loader's state before it
        self._data: tuple[Iterable[Batch], Iterator[Batch]] | None = None  # the data train() reads, and where
        self._resumed_position: dict[str, Any] | None = None  # a checkpoint's data position, for the next train()
        self._saved_at: tuple[int, int] | None = None
        self._rollout: tuple[int, list[Batch]] | None = None  # the step a rollout was made at, and its micro-batches

    # ---- what a trainer supplies -------------------------------------------------------------------------

    def engines(self) -> Mapping[str, Any]:
        """Each trained model's DeepSpeed engine by name (the Distiller's one student: the empty name)."""
        raise NotImplementedError

    def micro_batch(self, batch: Batch) -> Mapping[str, LossOutput]:
        """One micro-batch for every model: forwards, losses, backwards and engine steps; each loss by name."""
        raise NotImplementedError

    def make_batch(self, batch: Batch) -> Batch:
        """The micro-batch the models train on, made from the data's before the step counts its tokens; the data's
        own by default (on-policy sampling replaces rows with samples: ``on_policy.py``)."""
        return batch

    def make_batches(self, batches: list[Batch]) -> list[Batch]:
        """A step's micro-batches as trained on: each through ``make_batch`` (on-policy sampling may sample the
        whole step's rows together instead: ``on_policy.py``, ``generation_batch_size``)."""
        return [self.make_batch(batch) for batch in batches]

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps each step's made micro-batches are trained on: 1 (the default), a fresh batch every step;
        N > 1, a rollout made at one step and trained on again at the N - 1 steps after it, which read no data
        (``on_policy.updates_per_rollout``: PPO's epochs over its samples)."""
        return 1

    def stale_batches(self, batches: list[Batch]) -> list[Batch]:
        """A rollout's micro-batches as trained on again, at a step after the one that made them: as they were by
        default (the Distiller adds the sampling-time log-probabilities its clipped surrogate reads)."""
        return batches

    @property
    def reads_ahead(self) -> bool:
        """Read the next step's first micro-batch before the step's last one trains, so that ``upcoming`` is never
        empty (a served teacher's request, a paged teacher's weights go out across steps too, not only within a
        step's accumulation). Off by default: nothing in the process gains from it."""
        return False

    # ---- the loop ----------------------------------------------------------------------------------------

    def train(self, batches: Iterable[Batch], until: int | None = None, *, heldout: Iterable[Batch] | None = None,
              eval_every: int = 0, eval_batches: int | None = None) -> list[dict[str, float]]:
        """Run until optimizer step ``until`` (default ``training.max_steps``); one log record per step.

        ``batches`` yields this rank's micro-batches. Every rank must yield the same number (the ZeRO-3
        teacher's forward is a collective); a re-iterable (a DataLoader) is read again for more epochs.
        Calling again with a later ``until`` continues where the last call stopped.

        With ``heldout``, ``evaluate(heldout, eval_batches)`` runs inside the loop every ``eval_every`` steps and
        after the last (``eval_every`` 0: after the last only), before that step's checkpoint, so a resumed run
        never evaluates a step twice; each result is appended to ``evaluations`` and handed to ``on_evaluation``.

        Reliability (see ``checkpoint.py``, ``nonfinite.py``, ``preemption.py``): a checkpoint goes to
        ``training.checkpoint_dir`` every ``training.save_every`` steps, after the last step, and when SIGTERM or
        SIGINT reaches any rank: the step is finished, every rank saves and returns, and ``stopped_by`` names the
        signal. A step with a NaN/inf loss or gradient is skipped on every rank (``skipped_steps`` in the records).
        """
        until = self.training.max_steps if until is None else min(until, self.training.max_steps)
        engines = self.engines()
        for engine in engines.values():
            engine.train()
            schedule.resync(engine)  # a resumed run may have a new max_steps: the next step's lr is the schedule's
        self.stopped_by, self.stop_error = None, None
        first = len(self.history)
        micro_batches = self._micro_batches(batches)
        progress = tqdm(total=self.training.max_steps, initial=self.step, desc=type(self).__name__,
                        disable=not distributed.is_main(), dynamic_ncols=True)
        with preemption.StopRequest(self.device) as stop:
            while self.step < until:
                before = self._position()  # where a step the teacher or a reward could not finish starts again
                sums: dict[str, torch.Tensor] = {}
                stale = self._rollout is not None and self.step - self._rollout[0] < self.updates_per_rollout
                try:
                    if stale:  # the rollout made a few steps ago, trained on again: no data read
                        step_batches = self.stale_batches(self._rollout[1])
                    else:
                        step_batches = self.make_batches([self._next(micro_batches)
                                                          for _ in range(self.training.gradient_accumulation_steps)])
                        self.micro_batches_seen += len(step_batches)
                    normalizer, sequences = step_normalizers(step_batches, self.device)
                    started = time.perf_counter()
                    # The lr this step uses: read before the engines step, which moves each to the next step's.
                    lrs = {_key(name, "lr"): engine.get_lr()[0] for name, engine in engines.items()}
                    for index, batch in enumerate(step_batches):
                        # the next micro-batch, whose teacher outputs a teacher outside the processes may start on
                        self.upcoming = (step_batches[index + 1] if index + 1 < len(step_batches) else
                                         self._read_ahead(micro_batches) if self.step + 1 < until else None)
                        normalizers = {"loss_normalizer": normalizer, "sequence_normalizer": sequences}
                        for name, loss in self.micro_batch({**batch, **normalizers}).items():
                            for part, value in {"loss": loss.total.detach(), **loss.parts}.items():
                                key = _key(name, part)
                                sums[key] = sums.get(key, 0.0) + value.float() / len(step_batches)
                except StepFault as err:  # a server down too long or answering wrongly, a reward failing
                    self._ahead = None
                    self._restore_position(before)  # this step never happened: its checkpoint is the last whole one
                    self.stopped_by, self.stop_error = f"{err.what} ({err})", err
                    break
                if not stale and self.updates_per_rollout > 1:
                    self._rollout = (self.step, step_batches)
                means = distributed.all_reduce_sum(torch.stack(list(sums.values()))) / distributed.world_size()
                record = dict(zip(sums, means.tolist(), strict=True)) | lrs
                applied = self.nonfinite.all_or_none(
                    self.step + 1, {name: engine.was_step_applied() for name, engine in engines.items()}, record)
                if self.nonfinite.counts(self.step + 1, record, applied):
                    self.step += 1
                    record = {"step": self.step} | record | {"skipped_steps": self.nonfinite.skipped}
                    self.history.append(record)
                    progress.update(1)
                    tokens = float(normalizer) * len(step_batches) * distributed.world_size()
                    shown = {k: f"{v:.4g}" for k, v in record.items() if k.endswith(("loss", "reward_mean"))}
                    progress.set_postfix(shown | {"tok/s": f"{tokens / (time.perf_counter() - started):,.0f}"})
                    if self.on_record is not None:
                        self.on_record(record)
                    if self.step % self.training.log_every == 0 and distributed.is_main():
                        logger.info("step %d: %s", self.step, record)
                    if heldout is not None and _evaluates_at(self.step, eval_every, self.training.max_steps):
                        self._evaluate_in_loop(heldout, eval_batches)
                    if self.training.save_every and self.step % self.training.save_every == 0:
                        self._save_if_configured()
                if stop.agreed():
                    self.stopped_by = stop.received or "a signal on another rank"
                    break
        progress.close()
        if self.stopped_by or self.step == self.training.max_steps:
            self._save_if_configured()
        if self._rewound is not None:  # the next train() reads from the unfinished step's start, not the stream's
            self._resumed_position, self._data, self._rewound = self._rewound, None, None
        return self.history[first:]

    def evaluate(self, batches: Iterable[Batch], max_batches: int | None = None) -> dict[str, Any]:
        """Held-out figures of every model (the Distiller's: perplexities, agreement and KL with the teachers)."""
        raise NotImplementedError

    def _evaluate_in_loop(self, heldout: Iterable[Batch], max_batches: int | None) -> None:
        if any(done["step"] == self.step for done in self.evaluations):
            return
        result = {"step": self.step, **self.evaluate(heldout, max_batches)}
        self.evaluations.append(result)
        if self.on_evaluation is not None:
            self.on_evaluation(result)

    # ---- checkpoints -------------------------------------------------------------------------------------

    def save(self, directory: str | Path | None = None) -> Path:
        """Checkpoint everything needed to continue exactly into ``<directory>/step_<step>``, atomically.

        ``directory`` defaults to ``training.checkpoint_dir``. Every rank calls it (the engines' saves are
        collectives). Saving changes nothing that follows: each rank's random generators are put back after it.
        """
        directory = directory if directory is not None else self.training.checkpoint_dir
        if directory is None:
            raise ValueError("no checkpoint directory: pass one to save(), or set training.checkpoint_dir")
        rng = checkpoint.capture_rng()
        seen, loader_state = self._data_position()
        path = checkpoint.save(
            directory, self._checkpointed_engines(), step=self.step,
            trainer_state={"step": self.step, "history": self.history, "nonfinite": self.nonfinite.state_dict(),
                           "evaluations": self.evaluations},
            rank_state={"rng": rng, "micro_batches_seen": seen, "loader": loader_state, "rollout": self._rollout},
            teacher_sha256=self.teacher_sha256, keep_last=self.training.keep_checkpoints,
        )
        checkpoint.restore_rng(rng)
        self._saved_at = (self.step, self.micro_batches_seen)
        return path

    def load(self, path: str | Path) -> None:
        """Continue from a checkpoint: every engine, step, history, counters, this rank's random generators, and
        its data position (applied to the data the next ``train()`` is given).

        ``path`` is one checkpoint (a ``step_N`` folder) or a directory ``save()`` wrote them to (its latest
        complete one is loaded). A checkpoint that does not match its manifest is refused.
        """
        path = Path(path)
        reason = None
        if distributed.is_main():
            if (path / checkpoint.MANIFEST).is_file():
                reason = checkpoint.verify(path)
            else:
                found = checkpoint.latest_complete(path)
                path, reason = (found, None) if found is not None else (path, "it holds no complete checkpoint")
        path, reason = distributed.broadcast_object((path, reason))
        if reason is not None:
            raise ValueError(f"cannot load checkpoint {path}: {reason}")
        self._load(path)

    def resume(self, directory: str | Path | None = None) -> Path | None:
        """Load the latest complete checkpoint under ``directory`` (default ``training.checkpoint_dir``).

        Returns its path, or None when there is none yet (a fresh start). Incomplete or corrupt checkpoints are
        skipped with a warning; when every checkpoint there is, it raises rather than start again from step 0.
        Rank 0 chooses, so every rank loads the same one.
        """
        directory = directory if directory is not None else self.training.checkpoint_dir
        if directory is None:
            raise ValueError("nothing to resume from: pass a directory to resume(), or set training.checkpoint_dir")
        found, skipped = checkpoint.find_latest(directory) if distributed.is_main() else (None, [])
        found, skipped = distributed.broadcast_object((found, skipped))
        if found is None and skipped:
            raise ValueError(checkpoint.nothing_to_resume(directory, skipped))
        if found is not None:
            self._load(found)
        return found

    @property
    def teacher_sha256(self) -> str | None:
        """The frozen models' identity every checkpoint records and resume compares; None without one."""
        return None

    def _checkpointed_engines(self) -> dict[str, Any]:
        """Each engine under its folder in a checkpoint: its name, or ``deepspeed`` for the Distiller's one."""
        return {name or checkpoint.DEEPSPEED_TAG: engine for name, engine in self.engines().items()}

    def _load(self, path: Path) -> None:
        trainer_state, rank_state = checkpoint.load(path, self._checkpointed_engines(),
                                                    teacher_sha256=self.teacher_sha256)
        self.step, self.history = trainer_state["step"], trainer_state["history"]
        self.evaluations = trainer_state.get("evaluations", [])
        self.nonfinite.load_state_dict(trainer_state["nonfinite"])
        self.micro_batches_seen = rank_state["micro_batches_seen"]
        self._resumed_position = {"micro_batches_seen": self.micro_batches_seen, "loader": rank_state["loader"]}
        self._data, self._ahead = None, None
        rollout = rank_state.get("rollout")  # [step, micro-batches] of a run stopped inside a rollout
        self._rollout = None if rollout is None else (rollout[0], [self._to_device(b) for b in rollout[1]])
        checkpoint.restore_rng(rank_state["rng"])
        self._saved_at = (self.step, self.micro_batches_seen)
        if distributed.is_main():
            logger.info("resumed from %s at step %d", path, self.step)

    def _data_position(self) -> tuple[int, Any]:
        """This rank's micro-batches seen and its loader's state (None for data that keeps none), before any
        micro-batch read ahead: where a checkpoint, or a step the teacher could not finish, starts reading again."""
        if self._ahead is not None:
            return self.micro_batches_seen, self._ahead[1]
        loader = self._data[0] if self._data is not None else None
        return self.micro_batches_seen, loader.state_dict() if hasattr(loader, "state_dict") else None

    def _position(self) -> tuple[int, Any, dict[str, Any]]:
        """This rank's data position and random generators, as a step starts."""
        return (*self._data_position(), checkpoint.capture_rng())

    def _restore_position(self, position: tuple[int, Any, dict[str, Any]]) -> None:
        """Back to a step's start, so that the checkpoint taken next continues exactly there. A loader that keeps no
        state of its own is read past ``micro_batches_seen`` on resume; the stream here is not read on."""
        self.micro_batches_seen, state, rng = position
        if state is not None:
            self._data[0].load_state_dict(state)
        checkpoint.restore_rng(rng)
        self._rewound = {"micro_batches_seen": self.micro_batches_seen, "loader": state}

    def _save_if_configured(self) -> None:
        if self.training.checkpoint_dir is not None and self._saved_at != (self.step, self.micro_batches_seen):
            self.save()

    # ---- the data ----------------------------------------------------------------------------------------

    def _to_device(self, batch: Mapping[str, Any]) -> Batch:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _next(self, stream: Iterator[Batch]) -> Batch:
        """The next micro-batch: the one read ahead, if one was."""
        if self._ahead is not None:
            batch, self._ahead = self._ahead[0], None
            return batch
        return self._to_device(next(stream))

    def _read_ahead(self, stream: Iterator[Batch]) -> Batch | None:
        """The next step's first micro-batch, read now (``reads_ahead``), or None. It is not counted as seen until
        its step takes it, and where the data stood before it is what a checkpoint records, so a resumed run reads it
        again: reading ahead changes no step, only when a teacher hears of it."""
        if not self.reads_ahead:
            return None
        if self._ahead is None:
            _, state = self._data_position()
            self._ahead = (self._to_device(next(stream)), state)
        return self._ahead[0]

    def _micro_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """This rank's micro-batches: the same data as the last call continues its stream; other data is read
        from where it stands, except right after a resume, when it is put at the checkpoint's position: a loader
        with ``load_state_dict`` (``data.BlockLoader``) is given its saved state, and any other re-iterable is
        read past the micro-batches the run had used, so a list given whole resumes exactly too.
        """
        if self._data is not None and self._data[0] is batches:
            return self._data[1]
        if self._ahead is not None:  # other data now: the old data goes back to before what was read ahead of it
            if self._ahead[1] is not None:
                self._data[0].load_state_dict(self._ahead[1])
            self._ahead = None
        position, self._resumed_position = self._resumed_position, None
        stream = _cycle(batches)
        if position is not None and position["loader"] is not None and hasattr(batches, "load_state_dict"):
            batches.load_state_dict(position["loader"])
        elif position is not None:
            stream = itertools.islice(stream, position["micro_batches_seen"], None)
        self._data = (batches, stream)
        return stream


def step_normalizers(step_batches: list[Batch], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid tokens, and rows with a valid token, of the whole step (all micro-batches, all ranks) per micro-batch
    per rank; one all-reduce for both.

    DeepSpeed averages gradients over micro-batches and ranks; dividing each micro-batch's token sum by the first
    makes the result the exact per-token mean over the step, so neither micro-batch size nor accumulation
    changes the loss (see ``losses/base.py``). Every model of a group divides by the same one. The second is the
    same for a loss averaged per sequence (``policy_gradient`` with ``level: sequence``): it divides its sum of
    per-row means by it.
    """
    valid = [valid_positions(batch) for batch in step_batches]
    local = torch.stack([sum(v.sum() for v in valid), sum(v.any(dim=1).sum() for v in valid)])
    total = distributed.all_reduce_sum(local.to(device=device, dtype=torch.float32))
    tokens, rows = total.clamp(min=1) / (len(step_batches) * distributed.world_size())
    return tokens, rows


def _evaluates_at(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _key(name: str, part: str) -> str:
    """A record's key: the part, under the model's name in a group."""
    return f"{name}/{part}" if name else part


def _cycle(batches: Iterable[Batch]) -> Iterator[Batch]:
    """Epoch after epoch. A loader resumed at the very end of an epoch yields nothing once; two empty passes in
    a row mean there is no data."""
    empty_before = False
    while True:
        iterator = iter(batches)
        first = next(iterator, None)
        if first is None:
            if empty_before or iterator is batches:
                raise ValueError("the training data yielded no batches on this rank")
            empty_before = True
            continue
        empty_before = False
        yield first
        yield from iterator
        if iterator is batches:
            raise ValueError("the training data ran out before max_steps; pass a re-iterable such as a DataLoader")
