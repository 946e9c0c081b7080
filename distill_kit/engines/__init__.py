"""DeepSpeed configs, loading models under the right ZeRO layout, building the engines, distributed start-up.

DeepSpeed is first imported under this package, and here it is imported once without mlflow: its autotuner (a
feature this project never starts) imports mlflow at module level whenever mlflow is installed, and mlflow pulls
pandas, pyarrow and fastapi with it, about 2.5 s of CPU in every process (each rank, each CLI run) for nothing.
``sys.modules["mlflow"] = None`` makes that one ``import mlflow`` fail as if it were absent (DeepSpeed catches
it); the entry is removed right after, so the run's mlflow tracker (``run/trackers.py``) imports the real mlflow
as usual. Where mlflow or DeepSpeed is already imported, nothing changes.
"""

import sys

if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed  # noqa: F401
    finally:
        if sys.modules.get("mlflow", "") is None:
            del sys.modules["mlflow"]
