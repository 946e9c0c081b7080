"""Serve a teacher over HTTP, so a run distils from it without holding it (``TeacherSpec(model="http://...")``).

    python scripts/serve_teacher.py distill_kit/assets/default/teacher --port 8100          # the embedded default
    python scripts/serve_teacher.py /models/qwen2-7b --device cuda --dtype bf16 --port 8100 --api-key "$KEY"
    python scripts/serve_teacher.py /models/qwen2-72b --device cuda --precision fp8 --port 8100   # one H200

It answers vLLM's ``/v1/completions`` with ``prompt_logprobs`` (so a client written for vLLM works unchanged) and
the project's compact ``/v1/topk`` (raw arrays, the exact tail mass), and reports at ``/info`` and ``/v1/models``
its model, vocabulary size, tokenizer identity (the vocabulary's sha256) and weights' sha256, which the client
compares with the run's before any write. It binds 127.0.0.1 unless ``--host`` says otherwise; with ``--api-key``
(or ``DISTILL_KIT_TEACHER_API_KEY``) every request but ``/health`` needs ``Authorization: Bearer <key>``, as vLLM's
``--api-key``. Another interface without a key is refused unless ``--allow-unauthenticated`` says so. One
request's body, prompts and tokens are capped (``--max-request-bytes``, ``--max-request-rows``,
``--max-request-tokens``). The endpoints: ``distill_kit/teachers/served_server.py``; the client:
``teachers/served.py``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import time
from pathlib import Path

import torch

from distill_kit.engines import fp8, models
from distill_kit.engines.fingerprint import teacher_fingerprint
from distill_kit.teachers.served_server import Limits, Scorer, build_app

LOG = logging.getLogger("serve_teacher")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a save_pretrained folder (with its tokenizer, so clients can check theirs)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind; 0.0.0.0 exposes it to the network "
                                                            "(then give --api-key, or --allow-unauthenticated)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="serve a --host other than the loopback without --api-key: anyone who reaches the port "
                             "can use the teacher (a network you trust only)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--api-key", default=os.environ.get("DISTILL_KIT_TEACHER_API_KEY"),
                        help="required as 'Authorization: Bearer <key>' (default: $DISTILL_KIT_TEACHER_API_KEY)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="weights and compute (default: bf16 on a GPU, fp32 on the CPU)")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp8"), default="auto",
                        help="fp8: decoder layers in FP8 on one GPU (docs/fp8.md); needs --dtype bf16")
    parser.add_argument("--served-model-name", help="the name /v1/models reports (default: the folder's name)")
    parser.add_argument("--max-k", type=int, default=256, help="the largest k a request may ask for")
    parser.add_argument("--max-model-len", type=int, help="the longest prompt (default: the model's positions)")
    parser.add_argument("--max-batch-tokens", type=int, default=65536,
                        help="prompts run together in right-padded batches of at most this many tokens")
    limits = Limits()
    parser.add_argument("--max-request-rows", type=int, default=limits.rows,
                        help="prompts in one request; more is refused with HTTP 413 (default: %(default)s)")
    parser.add_argument("--max-request-tokens", type=int, default=limits.tokens,
                        help="prompt tokens in one request; more is refused with HTTP 413 (default: %(default)s)")
    parser.add_argument("--max-request-bytes", type=int, help="a request body's size; more is refused with HTTP 413 "
                                                              "as it arrives (default: 16 a token of "
                                                              "--max-request-tokens, plus 64 KiB)")
    parser.add_argument("--max-answer-bytes", type=int, default=limits.answer_bytes,
                        help="a /v1/topk answer's size (positions x (8 k + 4)); larger is refused with HTTP 413 "
                             "before the forward (default: %(default)s, the client's max_response_bytes)")
    parser.add_argument("--max-json-entries", type=int, default=limits.json_entries,
                        help="positions x (k + 1) of a /v1/completions answer, each a Python object while built; "
                             "more is refused with HTTP 413 (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--test-faults", action="store_true", help=argparse.SUPPRESS)  # tests: POST /test/fault
    parser.add_argument("--random-weights", action="store_true", help=argparse.SUPPRESS)  # benchmarks: shape only
    parser.add_argument("--bind-when-exists", type=Path, help=argparse.SUPPRESS)  # tests: a restart, loaded ahead
    parser.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, dict]:
    """The model on its device, and what ``/info`` reports of it."""
    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    config = models.model_config(args.model)
    if args.random_weights:  # a folder with only config.json: the benchmarks' shape-only teachers
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=models.TORCH_DTYPES[dtype])
        if fp8.resolve(args.precision, dtype) == "fp8":
            model = fp8.load(model, device)
    else:
        model = fp8.load_teacher(args.model, {}, dtype, fp8.resolve(args.precision, dtype), False, device,
                                 config=config)
    if getattr(model, "teacher_precision", None) != "fp8":
        model = model.to(device)
    model.requires_grad_(False).eval()
    text = config.get_text_config()
    tokenizer_sha256 = None
    if models.has_tokenizer(args.model):
        from transformers import AutoTokenizer

        from distill_kit.offline.fingerprints import tokenizer_fingerprint

        tokenizer_sha256 = tokenizer_fingerprint(AutoTokenizer.from_pretrained(args.model))
    from distill_kit.engines.head import EXACT_HEADS
    from distill_kit.teachers import served_protocol as protocol

    payloads = ["top_k", "sampled"]
    head = model.get_output_embeddings()
    if getattr(config, "model_type", None) in EXACT_HEADS and isinstance(head, torch.nn.Linear):
        payloads.append("hidden")  # logits are exactly head(final hidden state): the client may apply the head
    bias = getattr(head, "bias", None)
    hidden = {"head_sha256": protocol.head_digest(head.weight, bias), "hidden_size": int(head.weight.shape[1]),
              "hidden_dtype": protocol.dtype_name(head.weight.dtype), "head_bias": bias is not None
              } if "hidden" in payloads else {}
    info = {"model": args.served_model_name or Path(args.model).name, "vocab_size": int(text.vocab_size),
            "tokenizer_sha256": tokenizer_sha256, "teacher_sha256": teacher_fingerprint(model),
            "max_k": args.max_k, "max_model_len": args.max_model_len or getattr(text, "max_position_embeddings", None)
            or 1 << 20, "dtype": dtype, "precision": fp8.resolve(args.precision, dtype),
            "config": config.to_dict(), "payloads": payloads, **hidden}
    return model, info


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not loopback(args.host) and not args.api_key:
        if not args.allow_unauthenticated:
            raise SystemExit(f"serve_teacher.py: --host {args.host} without --api-key lets anyone who reaches the "
                             "port use the teacher: give --api-key (or DISTILL_KIT_TEACHER_API_KEY), bind 127.0.0.1 "
                             "and reach it through an SSH tunnel, or pass --allow-unauthenticated on a network you "
                             "trust")
        LOG.warning("binding %s without --api-key (--allow-unauthenticated): anyone who reaches the port can use "
                    "the teacher", args.host)
    for flag in ("max_request_rows", "max_request_tokens", "max_request_bytes", "max_answer_bytes", "max_json_entries"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"serve_teacher.py: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    model, info = load(args)
    limits = Limits(rows=args.max_request_rows, tokens=args.max_request_tokens, body_bytes=args.max_request_bytes,
                    answer_bytes=args.max_answer_bytes, json_entries=args.max_json_entries)
    app = build_app(Scorer(model, torch.device(args.device), args.max_batch_tokens), info, api_key=args.api_key,
                    test_faults=args.test_faults, limits=limits)
    import uvicorn

    while args.bind_when_exists is not None and not args.bind_when_exists.exists():
        time.sleep(0.05)

    LOG.info("serving %s (vocabulary %d, tokenizer %s) on http://%s:%d", info["model"], info["vocab_size"],
             (info["tokenizer_sha256"] or "none")[:12], args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback interface only (``localhost``, 127.0.0.0/8, ``::1``)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    main()
