"""DeepSpeed configs, loading models under the right ZeRO layout, building the engines, distributed start-up.

DeepSpeed is first imported under this package, and here it is imported once without mlflow: its autotuner (a
feature this project never starts) imports mlflow at module level whenever mlflow is installed, and mlflow pulls
pandas, pyarrow and fastapi with it, about 2.5 s of CPU in every process (each rank, each CLI run) for nothing.
``sys.modules["mlflow"] = None`` makes that one ``import mlflow`` fail as if it were absent (DeepSpeed catches
it); the entry is removed right after, so the run's mlflow tracker (``run/trackers.py``) imports the real mlflow
as usual. Where mlflow or DeepSpeed is already imported, nothing changes.

torchao (quantized students, FP8 teachers) is imported by transformers whenever it is installed, in every process
that loads a model. Two of its start-up messages say nothing a user can act on, so they are dropped, by their
exact text and nothing else: on a torch build without CUDA, that its CUDA kernels (``_C*.so``) do not load (they
cannot; its Python paths, which the CPU uses, do not need them); and torch's notice that the Enum types torchao
registers with ``torch.compile`` need no registering any more (torchao's call, deprecated in torch).
"""

import logging
import sys

import torch


class _Drop(logging.Filter):
    """Drops a logger's records whose message starts with one of ``starts``."""

    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


if torch.version.cuda is None:
    logging.getLogger("torchao").addFilter(_Drop("Failed to load "))
logging.getLogger("torch.utils._pytree").addFilter(_Drop("%s is an Enum subclass and is now natively supported"))

if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed  # noqa: F401
    finally:
        if sys.modules.get("mlflow", "") is None:
            del sys.modules["mlflow"]
