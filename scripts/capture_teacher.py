"""Capture a teacher once: its top-k next-token log-probabilities (and chosen hidden states) over a dataset.

Later runs distil from the store instead of the live teacher (``distill_kit.offline.captured_teacher``), which
removes the teacher's forward and its weights from every training step. Run it on every rank::

    torchrun --nproc_per_node 8 scripts/capture_teacher.py --teacher Qwen/Qwen2-72B \\
        --data corpus/*.jsonl --block-size 2048 --k 64 --out stores/qwen72b-k64

The blocks are built by ``distill_kit.data.blocks`` from the data flags below; a training run uses the same
store only with the same blocks (same files, tokenizer, block size, packing, held-out split and seed),
and refuses it otherwise. A stopped capture resumes when run again with the same arguments (there is no --resume
flag: the folder says what was done). ``--out`` must be a new or empty folder, or that capture's store: a folder of
other files, or a store started with other arguments, is refused before anything loads.

``--teacher`` may be a teacher server's URL (``scripts/serve_teacher.py``, vLLM, SGLang): the same store is filled
through the served-teacher client (``distill_kit/teachers/served_capture.py``); give ``--tokenizer``::

    python scripts/capture_teacher.py --teacher http://127.0.0.1:8100 --tokenizer path/to/teacher \
        --data corpus/*.jsonl --k 20 --out stores/served-k20
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from transformers import AutoTokenizer

from distill_kit.config import CONFIG_DIR, _safe_load
from distill_kit.data.blocks import DataConfig, build_splits
from distill_kit.engines import distributed
from distill_kit.errors import ConfigError, DataError, DeepSpeedConfigError
from distill_kit.offline.capture import CaptureConfig, capture, out_problem
from distill_kit.offline.store import Manifest
from distill_kit.teachers import served_capture
from distill_kit.teachers.kinds import is_url


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True,
                        help="a save_pretrained folder or hub name, or a teacher server's URL (http://host:port)")
    parser.add_argument("--tokenizer", help="tokenizer folder or hub name (default: the teacher's; a URL needs it)")
    parser.add_argument("--teacher-options", default="{}",
                        help="a served teacher's options as YAML/JSON, e.g. '{api: vllm, api_key_env: KEY}' "
                             "(distill_kit/teachers/served.py); --k sets k")
    parser.add_argument("--out", type=Path, required=True,
                        help="the store folder: new or empty, or this capture's store to resume it (same arguments)")
    parser.add_argument("--data", nargs="+", required=True, help="text/JSON(L)/Parquet files, or a hub dataset")
    parser.add_argument("--heldout", nargs="+", help="held-out files (default: a fraction of --data)")
    parser.add_argument("--split", choices=("train", "heldout"), default="train", help="which blocks to capture")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--block-size", type=int, default=DataConfig.block_size)
    parser.add_argument("--no-packing", dest="packing", action="store_false", help="one document per block")
    parser.add_argument("--heldout-fraction", type=float, default=DataConfig.heldout_fraction)
    parser.add_argument("--max-blocks", type=int, help="capture only the first N blocks of the split")
    parser.add_argument("--seed", type=int, default=DataConfig.seed, help="the held-out split's seed")
    defaults = CaptureConfig()
    parser.add_argument("--k", type=int, default=defaults.k, help="most likely next tokens kept per position")
    parser.add_argument("--targets", choices=("top_k", "sampled"), default=defaults.targets,
                        help="top_k: the k most likely tokens and the tail (any divergence); sampled: k tokens drawn "
                             "from the teacher at --temperature with their counts (RS-KD: forward KL's unbiased "
                             "estimate, 5.25 k bytes a token at Qwen2's vocabulary)")
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help="--targets sampled: the temperature the tokens are drawn at, which the training loss's "
                             "must equal")
    parser.add_argument("--values-dtype", choices=("fp16", "bf16", "fp32"), default=defaults.values_dtype,
                        help="of the stored log-probabilities (fp16: most precise of the 2-byte types here)")
    parser.add_argument("--hidden-layers", default="", help="comma-separated hidden-state indices to keep, e.g. 14,28")
    parser.add_argument("--hidden-dtype", choices=("fp16", "bf16", "fp32"), default=defaults.hidden_dtype)
    parser.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size)
    parser.add_argument("--batches-per-part", type=int, default=defaults.batches_per_part,
                        help="micro-batches per part file: what a stopped capture redoes at most")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=defaults.dtype,
                        help="the teacher's compute precision")
    parser.add_argument("--teacher-precision", choices=("auto", "bf16", "fp8"), default=defaults.teacher_precision,
                        help="fp8: the teacher's decoder layers in FP8 (torchao), replicated on every rank")
    parser.add_argument("--ds-config", default=str(CONFIG_DIR / "zero3_teacher.json"),
                        help="the teacher's DeepSpeed config (ZeRO-3 shards it over the ranks), filled and checked "
                             "as a run's teacher's")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    try:
        manifest = run(args)
    except (ConfigError, DataError, DeepSpeedConfigError, served_capture.CaptureStopped) as err:
        raise SystemExit(f"capture_teacher.py: {err}") from None
    if distributed.is_main():
        print(json.dumps({"store": str(args.out), **manifest.stats}, indent=2))


def run(args: argparse.Namespace) -> Manifest:
    """The store the arguments ask for: captured in-process, or through the served-teacher client for a URL."""
    served = is_url(args.teacher)
    if served and not args.tokenizer:
        raise ConfigError(f"--teacher {args.teacher} is a server: give --tokenizer, the folder of the served "
                          "model's tokenizer (its config.json too where the server reports no config)")
    options = _safe_load(args.teacher_options, "--teacher-options")
    if not isinstance(options, dict):
        raise ConfigError(f"--teacher-options {args.teacher_options!r}: give a mapping, e.g. '{{api: vllm}}'")
    hidden_layers = tuple(int(i) for i in args.hidden_layers.split(",") if i.strip())
    try:
        config = CaptureConfig(
            k=args.k, values_dtype=args.values_dtype, targets=args.targets, temperature=args.temperature,
            hidden_layers=hidden_layers,
            hidden_dtype=args.hidden_dtype, micro_batch_size=args.micro_batch_size,
            batches_per_part=args.batches_per_part, dtype=args.dtype,
            teacher_precision=args.teacher_precision,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # The folder, before anything loads (every rank, before any rank can write): what the arguments fix already.
    known = {"teacher": args.teacher, "k": args.k, "targets": args.targets, "temperature": args.temperature,
             "values_dtype": args.values_dtype,
             "hidden_layers": tuple(sorted(hidden_layers)), "hidden_dtype": args.hidden_dtype,
             "micro_batch_size": args.micro_batch_size, "batches_per_part": args.batches_per_part}
    problem = out_problem(args.out, known)
    if problem:
        raise ConfigError(problem)
    if not served:  # K past the vocabulary, from the config alone (a missing folder is the load's to report)
        from distill_kit.engines.models import model_config

        try:
            vocab = getattr(model_config(args.teacher).get_text_config(), "vocab_size", None)
        except (FileNotFoundError, OSError, ValueError):
            vocab = None
        if vocab is not None and args.k > vocab:
            raise ConfigError(f"--k {args.k}: above the teacher's vocabulary ({vocab} tokens); give --k {vocab} or "
                              "less")
    distributed.init()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.teacher)
    data = DataConfig(train=args.data, heldout=args.heldout, heldout_fraction=args.heldout_fraction,
                      text_field=args.text_field, block_size=args.block_size, packing=args.packing,
                      max_train_blocks=args.max_blocks, max_heldout_blocks=args.max_blocks, seed=args.seed)
    splits = build_splits(data, tokenizer)
    blocks = splits.train if args.split == "train" else splits.heldout
    if served:
        return served_capture.capture(args.teacher, tokenizer, blocks, args.out, config, options)
    return capture(args.teacher, tokenizer, blocks, args.out, config, ds_config=args.ds_config)


if __name__ == "__main__":
    main()
