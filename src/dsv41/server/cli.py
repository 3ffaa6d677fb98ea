"""`dsv41 serve`: the OpenAI-compatible server on loopback.

    dsv41 serve                                   # the default checkpoint, DEFAULT_CHECKPOINT
    dsv41 serve --checkpoint DIR --api-key KEY --prefix-store ~/.cache/dsv41/kv
    dsv41 serve --preset tiny --random-init --port 8001

See docs/server.md for the routes, batching and admission, and the error format.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path
from typing import Any

from dsv41.config import ConfigError
from dsv41.engine.cli import SHIPPED_MODEL

DEFAULT_CHECKPOINT = SHIPPED_MODEL  # what `dsv41 serve` loads without --checkpoint / --preset
log = logging.getLogger("dsv41.server")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)",
        description="Serve a model over the OpenAI API: /v1/models, /v1/completions, /v1/chat/completions,\n"
                    "/health and /metrics. Requests are batched continuously by one engine thread.",
        epilog="examples:\n  dsv41 serve --checkpoint models/dsv41-small --api-key secret\n"
               "  dsv41 serve --preset tiny --random-init --port 8001 --prefix-store /tmp/kv\n"
               "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
               "       -d '{\"model\": \"dsv41-small\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", type=Path, metavar="DIR",
                     help=f"checkpoint directory (default: {DEFAULT_CHECKPOINT})")
    src.add_argument("--preset", metavar="NAME", help="build a preset model (needs --random-init)")
    p.add_argument("--random-init", action="store_true", help="with --preset: random weights, no checkpoint")
    p.add_argument("--tokenizer", type=Path, metavar="PATH",
                   help="tokenizer.json (default: the checkpoint's, else the shipped one)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send (default: the checkpoint directory's name, or dsv41-PRESET)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("DSV41_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DSV41_API_KEY, else none)")
    p.add_argument("--prefix-store", type=Path, metavar="DIR", help="persistent prefix cache directory (global KV)")
    p.add_argument("--swa-pool", metavar="URL", help="window-snapshot pool: 'memory' or redis://HOST:PORT/DB "
                                                     "(needs --prefix-store; default with it: memory)")
    p.add_argument("--max-batch", type=int, default=32, help="sequences in the running batch (default 32)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429 (default 256)")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="KV memory admitted requests may reserve (default: half the free device memory)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="per-request limit in seconds: queued → 503, generating → cut with "
                        "finish_reason 'length' (default 600; 0 = none)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="request body limit → 413 (default 8 MiB)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; use fewer than the free cores on a shared box)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def free_memory_bytes(device) -> int:
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def kv_footprint(config) -> tuple[float, int]:
    """(global KV bytes per token, window bytes per sequence), measured from an empty sequence cache."""
    from dsv41.engine.cache import SequenceCache

    seq = SequenceCache(config, "cpu")
    return seq.bytes_per_token(), seq.window_bytes()


def build_server(model, tok, *, model_name: str, max_batch: int = 32, max_queue: int = 256,
                 kv_budget_bytes: int | None = None, timeout_s: float | None = 600.0, api_key: str | None = None,
                 max_body_bytes: int = 8 * 2**20, prefix_cache=None, prefill_chunk: int = 2048):
    """(app, scheduler) for a loaded model: what `dsv41 serve`, the tests and the load benchmark run."""
    from dsv41.engine.engine import Engine
    from dsv41.server.app import create_app
    from dsv41.server.metrics import ServerMetrics
    from dsv41.server.scheduler import Scheduler

    engine = Engine(model, prefill_chunk=prefill_chunk, max_batch=max_batch, prefix_cache=prefix_cache)
    per_token, window = kv_footprint(model.config)
    if kv_budget_bytes is None:
        kv_budget_bytes = free_memory_bytes(engine.device) // 2
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, max_queue=max_queue, kv_budget_bytes=kv_budget_bytes, bytes_per_token=per_token,
                          window_bytes=window, timeout_s=timeout_s or None, metrics=metrics)
    app = create_app(scheduler, tok, model_name=model_name, max_model_len=model.config.max_seq_len,
                     api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    return app, scheduler


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dsv41.engine.cli import load_model_and_tokenizer

    for name in ("max_batch", "max_queue", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.timeout < 0 or (args.kv_budget_gib is not None and args.kv_budget_gib <= 0):
        raise ConfigError("--timeout must be >= 0 and --kv-budget-gib > 0")
    if args.swa_pool and not args.prefix_store:
        raise ConfigError("--swa-pool needs --prefix-store (window snapshots extend persisted prefixes)")
    if args.preset is None and args.checkpoint is None:
        args.checkpoint = DEFAULT_CHECKPOINT
        if not DEFAULT_CHECKPOINT.exists():
            raise ConfigError(f"no checkpoint at the default path '{DEFAULT_CHECKPOINT}': pass --checkpoint DIR, "
                              "or --preset tiny --random-init to serve random weights")
    if args.checkpoint is not None and not args.checkpoint.exists():
        raise ConfigError(f"checkpoint directory '{args.checkpoint}' not found")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        import torch

        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    model, tok = load_model_and_tokenizer(args)

    prefix_cache = None
    if args.prefix_store:
        from dsv41.engine.prefix import PrefixCache
        from dsv41.engine.prefix_store import PersistentStore, make_swa_pool

        try:
            pool = make_swa_pool(args.swa_pool)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        prefix_cache = PrefixCache(model.config, PersistentStore(args.prefix_store), pool)
    name = args.served_model_name or (args.checkpoint.resolve().name if args.checkpoint else f"dsv41-{args.preset}")
    budget = int(args.kv_budget_gib * 2**30) if args.kv_budget_gib else None
    app, scheduler = build_server(model, tok, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue,
                                  kv_budget_bytes=budget, timeout_s=args.timeout, api_key=args.api_key,
                                  max_body_bytes=args.max_body_bytes, prefix_cache=prefix_cache,
                                  prefill_chunk=args.prefill_chunk)
    if not _is_loopback(args.host):
        log.warning("binding %s: reachable beyond this machine%s", args.host,
                    "" if args.api_key else " and WITHOUT an API key")
    log.info("serving '%s' on http://%s:%d/v1 (max batch %d, queue %d, KV budget %.2f GiB)", name, args.host,
             args.port, args.max_batch, args.max_queue, scheduler.budget.capacity / 2**30)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
