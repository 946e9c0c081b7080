"""Reading what a checkpoint holds without pickle's power to run code: a run directory is data, never a program.

distill-kit writes its own state as JSON and safetensors (``checkpoint.py``). Two things are still pickles:
DeepSpeed's engine files (optimizer states), which DeepSpeed 0.19 reads with ``torch.load(weights_only=False)``, and
the per-rank state of the older checkpoint format 1. Both are read here with ``torch.load(weights_only=True)``,
allowing only the plain types listed; a file that needs any other type is refused, naming it.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

DEEPSPEED_GLOBALS: list[Any] = [LossScaler, DynamicLossScaler, fragment_address, ZeroStageEnum]
"""What DeepSpeed 0.19's engine files hold besides tensors and containers (its ZeRO optimizer states: a loss-scaler
record, the address of each parameter fragment, the ZeRO stage): plain data types, so that :func:`weights_only`
reads the engines' files with ``torch.load(weights_only=True)`` allowing only these. A file that needs another type is
refused, naming it; a type you know to be plain data can be appended here."""


def pickled_rank_state(path: Path) -> dict[str, Any]:
    """A format-1 rank state (a pickle), through ``weights_only`` with numpy's plain array types only."""
    reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct  # numpy 2 renamed the module
    numpy_state = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct,
                   (reconstruct, "numpy.core.multiarray._reconstruct")]  # as a numpy 1 pickle names it
    try:
        with torch.serialization.safe_globals(numpy_state):
            state = torch.load(path, weights_only=True)
    except Exception as err:  # pickle raises many types; each means "not plain state"
        raise ValueError(f"refusing {path}: it holds more than plain state and could run code when loaded "
                         f"({str(err).splitlines()[0]}). Resume only checkpoints you trust; this one was not "
                         "written by distill-kit as it is.") from None
    return state


def load_weights_only(path: str, map_location: Any = None) -> Any:
    """DeepSpeed's ``TorchCheckpointEngine.load``, without pickle's power to run code (see DEEPSPEED_GLOBALS)."""
    try:
        with torch.serialization.safe_globals(DEEPSPEED_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"refusing DeepSpeed checkpoint file {path}: it holds more than tensors and plain data, and loading it "
            f"could run code ({str(err).splitlines()[0]}). If you wrote it and the type it names is plain data, "
            "append that type to distill_kit.training.safe_load.DEEPSPEED_GLOBALS."
        ) from None


@contextmanager
def weights_only(engines: Iterable[Any]) -> Iterator[None]:
    """While loading, the engines read their files through :func:`load_weights_only` (DeepSpeed's own
    ``TorchCheckpointEngine`` unpickles them with ``weights_only=False``); other checkpoint engines are left."""
    patched = [e.checkpoint_engine for e in engines
               if isinstance(getattr(e, "checkpoint_engine", None), TorchCheckpointEngine)]
    for checkpoint_engine in patched:
        checkpoint_engine.load = load_weights_only
    try:
        yield
    finally:
        for checkpoint_engine in patched:
            del checkpoint_engine.load
