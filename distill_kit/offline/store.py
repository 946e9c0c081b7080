"""The on-disk format of a captured teacher: per token, its top-k log-probabilities, their ids and the tail.

Why a store: distillation runs repeat over the same corpus (sweeps, several students, epochs), and the
teacher's forward is the dominant cost of each step. Run it once (``scripts/capture_teacher.py``), keep
what the losses need, and every later run reads it instead (``distill_kit/offline/captured_teacher.py``).

Layout of a store folder::

    manifest.json                     what was captured (teacher, tokenizer, k, dtypes, dataset) and progress
    rank00000/part-00000000.safetensors   micro-batches [0, n) of rank 0, written whole or not at all
    rank00001/part-00000000.safetensors   ...

Each part holds, for the blocks (sequences) it covers, one row per real token (``attention_mask`` 1):

* ``log_probs`` (tokens, k): log p of the k most likely next tokens at temperature 1, most likely first,
  in ``values_dtype`` (fp16 by default: log-probabilities lie in about [-100, 0], where fp16 has 8x the
  precision of bf16 at the same 2 bytes);
* ``ids`` (tokens, k): their token ids in the fewest bytes the vocabulary allows (:class:`IdCodec`):
  uint8 up to 256 ids, uint16 up to 65,536, and above that the low 16 bits plus the high bits packed
  separately (2.25 bytes an id for Qwen2's 151,936) instead of 4;
* ``log_tail`` (tokens,): log of the probability outside the k ids (the tail bucket), as a logsumexp
  over those ids' logits rather than ``1 - sum``, so small tails stay accurate;
* ``hidden.<layer>`` (tokens, H): chosen hidden states, if asked for;
* ``keys`` (blocks, 16) and ``offsets`` (blocks + 1): a hash of each block's tokens and where its rows
  start. A reader finds a block by the hash of its tokens, so the training data may come in any order,
  micro-batch size or number of ranks, and a batch from another dataset is caught, not misread.

For k = 64 at Qwen2's vocabulary that is 64 x (2 + 2.25) + 2 = 274 bytes a token, against 384 for bf16
values, uint32 ids and a bf16 tail; the manifest records the measured figure, file overheads included.

A **sampled** store (``targets: sampled``, ``capture_teacher.py --targets sampled``; RS-KD, Anshumann et al., ACL
2025) keeps instead, per token, K tokens drawn from the teacher's distribution at the loss's ``temperature``: the
distinct ids drawn (``ids``, padded to K slots), how often each was (``counts`` (tokens, K) uint8, 0 in unused
slots) and their ``log_probs`` at that temperature; no tail. The forward-KL loss's estimate from them is unbiased
(``losses/functional.py:sampled_forward_kl``), where top-k's is biased toward the head. Bytes a token: K x (2.25 +
1 + 2) = 5.25 K at Qwen2's vocabulary (K = 12: 63, K = 19: 99.75), 5 K at a vocabulary up to 65,536.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from distill_kit.engines.models import TORCH_DTYPES
from distill_kit.errors import ConfigError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KEY_BYTES = 16
TOP_K_TENSORS = ("log_probs", "log_tail", "ids", "ids_high", "counts")
TARGETS = ("top_k", "sampled")
ELEMENT_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "U8": 1, "U16": 2, "I32": 4, "I64": 8}  # safetensors dtype names


def block_key(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bytes:
    """The identity of one sequence: a hash of its real tokens (padding left out), as int64 bytes."""
    ids = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
    return hashlib.blake2b(ids.to(torch.int64).cpu().numpy().tobytes(), digest_size=KEY_BYTES).digest()


class IdCodec:
    """Token ids in the fewest whole bytes the vocabulary needs, plus packed high bits past 16.

    Up to 2**16 ids: one uint8 or uint16 per id. Up to 2**24: the low 16 bits as uint16 and the rest
    (1, 2, 4 or 8 bits, the smallest that divides a byte) packed into a separate uint8 array, so an id of
    a 151,936-token vocabulary costs 2.25 bytes. Larger vocabularies use int32.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        bits = max(1, (vocab_size - 1).bit_length())
        self.high_bits = next((b for b in (0, 1, 2, 4, 8) if bits <= 16 + b), None) if bits > 8 else 0
        self.low_dtype = torch.uint8 if bits <= 8 else torch.uint16 if self.high_bits is not None else torch.int32

    @property
    def bytes_per_id(self) -> float:
        return torch.empty((), dtype=self.low_dtype).element_size() + (self.high_bits or 0) / 8

    def encode(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``ids`` (n, k) int64 -> the tensors to store: ``ids`` and, past 16 bits, ``ids_high``."""
        if not self.high_bits:
            return {"ids": ids.to(self.low_dtype)}
        per_byte = 8 // self.high_bits
        high = (ids >> 16).to(torch.uint8)
        high = torch.nn.functional.pad(high, (0, -high.shape[-1] % per_byte))  # (n, whole bytes * per_byte)
        shifts = torch.arange(per_byte, dtype=torch.uint8) * self.high_bits
        packed = (high.view(high.shape[0], -1, per_byte) << shifts).sum(-1, dtype=torch.uint8)
        return {"ids": (ids & 0xFFFF).to(torch.int32).to(torch.uint16), "ids_high": packed}

    def decode(self, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The inverse of :meth:`encode`: (n, k) int64."""
        low = stored["ids"].to(torch.int64)
        if not self.high_bits:
            return low
        per_byte = 8 // self.high_bits
        shifts = torch.arange(per_byte, dtype=torch.uint8) * self.high_bits
        high = (stored["ids_high"].unsqueeze(-1) >> shifts) & ((1 << self.high_bits) - 1)
        return low | (high.reshape(low.shape[0], -1)[:, : low.shape[1]].to(torch.int64) << 16)


@dataclass(frozen=True)
class StoreSpec:
    """Everything that decides whether a store fits a run; fixed when a capture starts."""

    teacher: str
    """The teacher's path or hub name, as given."""
    teacher_hash: str
    """``fingerprint.teacher_fingerprint``: sha256 of its weights, whatever the ZeRO layout."""
    teacher_config: dict[str, Any]
    """The teacher's ``config.to_dict()``: vocabulary, width and depth for the losses and ZeRO sizes."""
    tokenizer: str
    tokenizer_hash: str
    """sha256 of the tokenizer's vocabulary: token ids must mean the same tokens in the training run."""
    dataset: str
    """:func:`dataset_fingerprint` of the tokenised blocks captured."""
    k: int
    values_dtype: str = "fp16"
    hidden_layers: tuple[int, ...] = ()
    hidden_dtype: str = "bf16"
    targets: str = "top_k"
    """``top_k``: the k most likely tokens and the tail; ``sampled``: k tokens drawn at ``temperature`` (RS-KD)."""
    temperature: float = 1.0
    """A sampled store's: the temperature its tokens were drawn at, which the loss's must equal."""

    def __post_init__(self) -> None:
        vocab = self.teacher_config.get("vocab_size")
        if not 1 <= self.k <= (vocab or self.k):
            raise ValueError(f"k must be in [1, the teacher's vocabulary ({vocab})], got {self.k}")
        if self.targets not in TARGETS:
            raise ValueError(f"targets must be one of {', '.join(TARGETS)}, got {self.targets!r}")
        if self.targets == "sampled" and self.k > 255:
            raise ValueError(f"a sampled store draws at most 255 tokens a position (its counts are uint8), got k = "
                             f"{self.k}")
        if not (isinstance(self.temperature, int | float) and self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        for name in ("values_dtype", "hidden_dtype"):
            if getattr(self, name) not in TORCH_DTYPES:
                raise ValueError(f"{name} must be one of {sorted(TORCH_DTYPES)}, got {getattr(self, name)!r}")
        object.__setattr__(self, "hidden_layers", tuple(sorted(int(i) for i in self.hidden_layers)))
        # As JSON gives it back (string keys, lists), so a spec read from a manifest equals the one written.
        object.__setattr__(self, "teacher_config", json.loads(json.dumps(self.teacher_config, default=str)))

    @property
    def vocab_size(self) -> int:
        return int(self.teacher_config["vocab_size"])


@dataclass
class Manifest:
    """``manifest.json``: the spec, how the capture was laid out over ranks, and what it reached."""

    spec: StoreSpec
    world_size: int
    micro_batch_size: int
    batches_per_part: int
    complete: bool = False
    stats: dict[str, float] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def save(self, root: Path) -> None:
        temporary = root / f".{MANIFEST}.tmp"
        temporary.write_text(json.dumps(asdict(self), indent=2))
        os.replace(temporary, root / MANIFEST)

    @classmethod
    def load(cls, root: Path) -> Manifest:
        path = Path(root) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(
                f"{root} is not a teacher store (no {MANIFEST}); make one with scripts/capture_teacher.py"
            )
        not_a_store = (f"{root} is not a teacher store: its {MANIFEST} is not one scripts/capture_teacher.py "
                       "writes")
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            raise ConfigError(f"{not_a_store} (not JSON)") from None
        if not isinstance(data, dict) or not isinstance(data.get("spec"), dict) or "format_version" not in data:
            raise ConfigError(f"{not_a_store} (no spec or format_version)")
        if data["format_version"] != FORMAT_VERSION:
            raise ConfigError(f"{root} holds a teacher store of format {data['format_version']!r}, and this version "
                              f"of distill-kit reads format {FORMAT_VERSION}: capture the teacher again into a new "
                              "folder with this version's scripts/capture_teacher.py")
        try:
            data["spec"] = StoreSpec(**data["spec"])
            return cls(**data)
        except (TypeError, ValueError, KeyError) as err:
            raise ConfigError(f"{not_a_store} ({err})") from None


def part_path(root: Path, rank: int, first_batch: int) -> Path:
    return Path(root) / f"rank{rank:05d}" / f"part-{first_batch:08d}.safetensors"


def completed_batches(root: Path, rank: int) -> int:
    """Micro-batches this rank has on disk: parts are written in order and whole, so the last one's end."""
    ends = [0]
    for path in (Path(root) / f"rank{rank:05d}").glob("part-*.safetensors"):
        with safe_open(path, framework="pt") as part:
            ends.append(int(part.metadata()["end_batch"]))
    return max(ends)


class PartWriter:
    """One rank's rows, gathered micro-batch by micro-batch and written as one part per ``flush``."""

    def __init__(self, root: Path, rank: int, spec: StoreSpec):
        self.root, self.rank, self.spec = Path(root), rank, spec
        self.codec = IdCodec(spec.vocab_size)
        self._rows: dict[str, list[torch.Tensor]] = {}
        self._keys: list[bytes] = []
        self._lengths: list[int] = []

    def add(self, key: bytes, log_probs: torch.Tensor, ids: torch.Tensor, log_tail: torch.Tensor,
            hidden: Mapping[int, torch.Tensor]) -> None:
        """One block's rows: ``log_probs``/``ids`` (n, k), ``log_tail`` (n,), ``hidden[layer]`` (n, H); a sampled
        store's third are the ``counts`` (n, k)."""
        values_dtype = TORCH_DTYPES[self.spec.values_dtype]
        floor = torch.finfo(values_dtype).min  # k = V leaves no tail: log 0 is stored as the lowest finite value
        third = ({"counts": log_tail.to(torch.uint8)} if self.spec.targets == "sampled"
                 else {"log_tail": log_tail.clamp(min=floor).to(values_dtype)})
        rows = {"log_probs": log_probs.clamp(min=floor).to(values_dtype), **third, **self.codec.encode(ids)}
        rows |= {f"hidden.{layer}": state.to(TORCH_DTYPES[self.spec.hidden_dtype]) for layer, state in hidden.items()}
        for name, value in rows.items():
            self._rows.setdefault(name, []).append(value.contiguous())
        self._keys.append(key)
        self._lengths.append(log_probs.shape[0])

    def flush(self, first_batch: int, end_batch: int) -> int:
        """Write micro-batches ``[first_batch, end_batch)`` as one part (atomically); returns its tokens."""
        path = part_path(self.root, self.rank, first_batch)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: torch.cat(values) for name, values in self._rows.items()}
        # A rank may hold no block in its last part (the loader's filler): the part still marks progress.
        tensors["keys"] = torch.tensor(list(b"".join(self._keys)), dtype=torch.uint8).reshape(-1, KEY_BYTES)
        tensors["offsets"] = torch.tensor([0, *np.cumsum(self._lengths).tolist()], dtype=torch.int64)
        temporary = path.with_suffix(".tmp")
        save_file(tensors, temporary, metadata={"first_batch": str(first_batch), "end_batch": str(end_batch)})
        os.replace(temporary, path)
        tokens = sum(self._lengths)
        self._rows, self._keys, self._lengths = {}, [], []
        return tokens


def parts(root: Path) -> Iterator[Path]:
    yield from sorted(Path(root).glob("rank*/part-*.safetensors"))


def store_stats(root: Path, spec: StoreSpec) -> dict[str, float]:
    """Tokens, blocks and bytes on disk; bytes per token with and without hidden states and file overheads."""
    tokens = blocks = 0
    payload = 0
    for path in parts(root):
        with safe_open(path, framework="pt") as part:
            offsets = part.get_tensor("offsets")
            tokens += int(offsets[-1])
            blocks += len(offsets) - 1
            for name in part.keys():
                if name in TOP_K_TENSORS:
                    sliced = part.get_slice(name)
                    payload += int(np.prod(sliced.get_shape())) * ELEMENT_BYTES[sliced.get_dtype()]
    on_disk = sum(path.stat().st_size for path in parts(root))
    return {"tokens": tokens, "blocks": blocks, "bytes_on_disk": on_disk,
            "bytes_per_token": on_disk / max(tokens, 1), "top_k_bytes_per_token": payload / max(tokens, 1)}



class StoreReader:
    """A finished store, opened for lookups by block: every part memory-mapped, an index from block hash to rows."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest = Manifest.load(self.root)
        if not self.manifest.complete:
            raise ValueError(
                f"the teacher store {self.root} is incomplete: its capture stopped before the end. Run "
                "scripts/capture_teacher.py again with the same arguments; it resumes where it stopped."
            )
        self.spec = self.manifest.spec
        self.codec = IdCodec(self.spec.vocab_size)
        self._parts = [safe_open(path, framework="pt") for path in parts(self.root)]
        self._index: dict[bytes, tuple[int, int, int]] = {}
        for number, part in enumerate(self._parts):
            offsets = part.get_tensor("offsets").tolist()
            for row, key in enumerate(part.get_tensor("keys").numpy()):
                self._index.setdefault(key.tobytes(), (number, offsets[row], offsets[row + 1]))

    def __len__(self) -> int:
        """Distinct blocks held."""
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def rows(self, key: bytes) -> dict[str, torch.Tensor]:
        """One block's rows, one per real token: ``log_probs`` and ``ids`` (n, k), ``log_tail`` (n,), ``hidden.<l>``."""
        if key not in self._index:
            raise KeyError(
                f"a sequence of this batch is not in the teacher store {self.root}, captured from dataset "
                f"{self.spec.dataset}: train on the blocks it was captured from (same data, tokenizer and "
                "block_size), or capture this dataset with scripts/capture_teacher.py"
            )
        number, start, end = self._index[key]
        part = self._parts[number]
        names = [name for name in part.keys() if name not in ("keys", "offsets")]
        stored = {name: part.get_slice(name)[start:end] for name in names}
        ids = self.codec.decode(stored)
        return {name: value for name, value in stored.items() if not name.startswith("ids")} | {"ids": ids}

