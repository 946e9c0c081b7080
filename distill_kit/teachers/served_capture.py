"""Offline capture from a served teacher: a store filled through the served-teacher client instead of an engine.

``scripts/capture_teacher.py --teacher http://host:port`` calls :func:`capture`. The store is the one an in-process
capture writes (``offline/capture.py:fill_store``: the same parts, keys and manifest), each micro-batch's rows asked
of the server by :class:`~distill_kit.teachers.served.ServedTeacher`, the client a run uses, so the server's answers
are checked as a run checks them (other tokens, another k, a truncated body: refused, never stored).

A store holds one row per real token, the last one the teacher's prediction after the whole block; a server scores
a prompt's positions but its last (``served_protocol``). So each block is sent with one more token after its end
(its own last token again: any id would do, a causal model's earlier positions never see it), and the row that
token's position gives is that prediction.

A sampled store (``--targets sampled``) is drawn on this side from the teacher's whole distribution: the server
sends its final hidden states (``payload: hidden``, the project's server only) and the client applies the head and
samples (``offline/capture.py:sample``), as an in-process capture does from the logits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F

from distill_kit.config import TeacherSpec
from distill_kit.engines import models
from distill_kit.errors import ConfigError
from distill_kit.offline.capture import CaptureConfig, Rows, fill_store, targets_of
from distill_kit.offline.store import Manifest
from distill_kit.teachers import kinds, served
from distill_kit.teachers.base import TeacherSetup
from distill_kit.teachers.served import ServedTeacher
from distill_kit.teachers.served_protocol import TeacherResponseError, TeacherUnavailable
from distill_kit.teachers.tokenizers import fingerprint_problems


def capture(url: str, tokenizer: Any, blocks: datasets.Dataset, out: str | Path, config: CaptureConfig | None = None,
            options: Mapping[str, Any] | None = None) -> Manifest:
    """Capture the teacher served at ``url`` over ``blocks`` into the store ``out`` (module docstring).

    ``options``: the served teacher's (``teachers/served.py``: ``api``, ``api_key_env``, ``timeout_s``, ...), but
    ``k``, which is the store's (``config.k``), and ``tail``, which a store always keeps. Refused before anything is
    written, each in one line naming the flag and the fix: hidden layers (a server gives none), a k above the
    server's, a tokenizer other than the server's (by vocabulary sha256, as a run compares a served teacher's), no
    model config to record, a server that cannot answer a first request.
    """
    config = config or CaptureConfig()
    if config.hidden_layers:
        raise ConfigError("--hidden-layers: a served teacher gives top-k log-probabilities only; capture hidden "
                          "states in-process (--teacher with the model's folder)")
    given = sorted(set(options or {}) & {"k", "tail", "payload"})
    if given:
        raise ConfigError(f"--teacher-options: {given} are the store's, not the server's; give --k (a store always "
                          "keeps the tail) and --targets")
    sampled = config.targets == "sampled"
    api = (options or {}).get("api", "distill_kit")
    if sampled and api != "distill_kit":
        raise ConfigError(f"--targets sampled from --teacher {url}: the draws are made from the teacher's whole "
                          f"distribution, which only the project's server sends (its hidden states); a {api} server "
                          "gives top-k log-probabilities: capture --targets top_k from it, or serve the teacher with "
                          "scripts/serve_teacher.py")
    spec = TeacherSpec(name="capture", model=url, kind="served",
                       options={**(options or {}), "k": config.k, "tail": True}
                       | ({"payload": "hidden"} if sampled else {}))
    unknown = sorted(set(spec.options) - set(ServedTeacher.options))
    if unknown:
        raise ConfigError(f"--teacher-options: {unknown} are not options of a served teacher; it takes "
                          f"{[name for name in ServedTeacher.options if name not in ('k', 'tail')]}")
    with served.named_as(FLAGS):  # the client's errors name this script's flags, not a run config's keys
        return _capture(spec, url, tokenizer, blocks, out, config)


FLAGS = served.Labels(model="--teacher", options="--teacher-options", sep=" ",
                      stop="the capture stops, the parts written so far kept",
                      resume="run the same capture command again (it resumes where the store stopped)")
"""How the served client's messages name the server and its options in this script (``capture_teacher.py``)."""


def _capture(spec: TeacherSpec, url: str, tokenizer: Any, blocks: datasets.Dataset, out: str | Path,
             config: CaptureConfig) -> Manifest:
    info = served.server_info(str(url).rstrip("/"), served.options_of(spec), FLAGS)
    if spec.options.get("payload") != "hidden" and info.get("max_k") is not None and config.k > int(info["max_k"]):
        raise ConfigError(f"--k {config.k}: the teacher server at {url} gives at most {info['max_k']} tokens a "
                          f"position; capture with --k {info['max_k']} or less, or restart the server with a larger "
                          "--max-k (vllm serve: --max-logprobs)")
    card = kinds.describe(spec)  # the server's tokenizer, positions and config, as a run's teacher reads them
    problems = fingerprint_problems([(f"--teacher {url}", card)], tokenizer, "--tokenizer")
    if problems:
        raise ConfigError(problems[0] + ", or give --tokenizer the server model's tokenizer")
    teacher_config = card.config or _local_config(tokenizer, url)
    teacher = ServedTeacher(spec, card, TeacherSetup(ds_config={}, training=config.training(),
                                                     device=torch.device("cpu")))
    try:
        first = torch.as_tensor(blocks[0]["input_ids"][:1])[None]
        try:  # one block of one token: the server's limits and dialect met before any write
            store_rows(teacher, {"input_ids": first, "attention_mask": torch.ones_like(first)}, 1, config)
        except TeacherResponseError as err:
            raise ConfigError(f"--teacher {url}: its answer at --k {config.k} cannot fill a store ({err}); check --k "
                              "against the server's limit (vllm serve --max-logprobs) and --teacher-options' api"
                              ) from None
        try:
            return fill_store(lambda batch, real: store_rows(teacher, batch, real, config), url, teacher.identity,
                              teacher_config.to_dict(), tokenizer, blocks, out, config)
        except TeacherUnavailable as err:  # gone, or too slow: what a run says of it, less a run's --resume advice
            raise CaptureStopped(f"--teacher {url} stopped answering mid-capture: {_cause(err)}. {_resumes(out)}"
                                 ) from None
        except TeacherResponseError as err:
            raise CaptureStopped(f"--teacher {url} gave an answer mid-capture that cannot be stored, so nothing of "
                                 f"it was: {_cause(err)}. {_resumes(out)}") from None
    finally:
        teacher.close()


class CaptureStopped(TeacherUnavailable):
    """A served capture stopped part-way by its server; the message names the cause, and that running the same
    command again resumes (the parts finished are kept: ``offline/capture.py``)."""


def _resumes(out: str | Path) -> str:
    return (f"The parts finished so far are kept in {out}: once the server answers again, run the same command "
            "again; it resumes at the last finished part")


def _cause(err: Exception) -> str:
    """The client's message without its advice for a training run (a checkpoint, ``--resume``): clauses naming
    either are left out."""
    clauses = re.split(r"(?<=[.;]) (?=[A-Za-z])", str(err))
    kept = [c for c in clauses if not re.search(r"resume|checkpoint", c, re.IGNORECASE)]
    return " ".join(kept or clauses[:1]).rstrip(" .;")


def store_rows(teacher: ServedTeacher, batch: Mapping[str, torch.Tensor], real: int,
               config: CaptureConfig | None = None) -> Rows:
    """The store's rows of the micro-batch's first ``real`` blocks (right-padded, as ``data/blocks.py`` makes them),
    each block sent with one more token so that its last real position is scored too (module docstring). Filler
    rows (the rest) are not sent: a server's forward is no collective."""
    ids, mask = batch["input_ids"][:real], batch["attention_mask"][:real].long()
    lengths, rows = mask.sum(1), torch.arange(real)
    if not torch.equal(mask.bool(), torch.arange(mask.shape[1]) < lengths[:, None]):
        raise ValueError("served capture needs right-padded blocks (attention_mask 1 then 0), as "
                         "data.blocks.tokenize_to_blocks builds them")
    wide_ids, wide_mask = F.pad(ids, (0, 1)), F.pad(mask, (0, 1))
    wide_ids[rows, lengths], wide_mask[rows, lengths] = ids[rows, lengths - 1], 1
    out = teacher.forward({"input_ids": wide_ids, "attention_mask": wide_mask})
    keep = F.pad(mask, (0, 1)).bool()
    if config is not None and config.targets == "sampled":  # the head applied here, one micro-batch at a time
        values, ids, counts = targets_of(out.logits[keep], ids, config)
        return values, ids, counts, {}
    targets = out.logits
    return targets.log_probs[keep], targets.ids[keep], targets.log_tail[keep], {}


def _local_config(tokenizer: Any, url: str) -> Any:
    """The model config where the server reports none (vLLM, SGLang): the tokenizer's folder's, if it holds one."""
    folder = getattr(tokenizer, "name_or_path", None)
    if folder and (Path(folder) / "config.json").is_file():
        return models.model_config(folder)
    raise ConfigError(f"--teacher {url}: the server reports no model config, which a store records (vocabulary, "
                      f"width, depth), and --tokenizer {folder!r} holds no config.json; point --tokenizer at the "
                      "served model's folder, or serve it with scripts/serve_teacher.py")
