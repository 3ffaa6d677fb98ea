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
from dsv41.engine.cli import SHIPPED_MODEL, add_prefill_options

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
    p.add_argument("--api-key", metavar="KEY", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*; repeat for several tenants, each with its own "
                        "prefix-cache namespace (default: $DSV41_API_KEY, comma-separated, else none)")
    p.add_argument("--allowed-hosts", metavar="H,H", default=None,
                   help="Host headers accepted (DNS-rebinding guard; default: the bound address, localhost, "
                        "127.0.0.1, ::1; '*' = any)")
    p.add_argument("--cors-origins", metavar="O,O", default=None,
                   help="allow browser requests from these origins (CORS; default: off)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: stop admission, let running streams finish for up to S seconds, then end the "
                        "rest with an error event (default 30)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="a request body that does not arrive within S seconds gets 408 (default 30)")
    p.add_argument("--prefix-stride", type=int, default=256, metavar="N",
                   help="tokens between forced prefix-unit cuts (besides message boundaries and prompt ends)")
    p.add_argument("--max-concurrent-tokenize", type=int, default=4, metavar="N",
                   help="tokenizations running at once on the worker threads (default 4)")
    p.add_argument("--prefix-store", type=Path, metavar="DIR", help="persistent prefix cache directory (global KV)")
    p.add_argument("--swa-pool", metavar="URL", help="window-snapshot pool: 'memory' or redis://HOST:PORT/DB "
                                                     "(needs --prefix-store; default with it: memory)")
    p.add_argument("--max-batch", type=int, default=32, help="sequences in the running batch (default 32)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before the last one's tokens are read, so the host's bookkeeping "
                        "runs beside the device (docs/engine.md; default: on with CUDA, off with --speculative, "
                        "where --overlap overlaps the plain steps its cost model chooses)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="before serving, run a few throwaway prompts so that every kernel shape is compiled "
                        "(Engine.warm_up: no multi-second stall at the first odd-length prompt; default: on with CUDA)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429 (default 256)")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="memory of the engine's KV pools, allocated once at start-up (default: half the free "
                        "device memory, at most what max-batch sequences of the full context need)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="per-request limit in seconds: queued → 503, generating → cut with "
                        "finish_reason 'length' (default 600; 0 = none)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="request body limit → 413 (default 8 MiB)")
    add_prefill_options(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="weights and activations: auto (default) = bf16 on CUDA (the head, routers, "
                        "compressors, mHC coefficients and sinks stay fp32), fp32 elsewhere; part of the prefix "
                        "store's model identity")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's; use fewer than the free cores on a shared box)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--speculative", choices=["off", "dspark", "oracle"], default="off",
                   help="speculative decoding with the checkpoint's DSpark drafter (or the model itself as an "
                        "oracle, a mechanism test); default off (docs/speculative.md)")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="tokens drafted per step (default: dspark_block_size - 1, or 4)")
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


def build_server(model, tok, *, model_name: str, max_batch: int = 32, max_queue: int = 256,
                 kv_budget_bytes: int | None = None, timeout_s: float | None = 600.0,
                 api_key: str | list[str] | None = None, max_body_bytes: int = 8 * 2**20, prefix_cache=None,
                 prefill_chunk: int | None = None, engine_options: dict | None = None, **app_options):
    """(app, scheduler) for a loaded model: what `dsv41 serve`, the tests and the load benchmark run.
    `app_options` go to `create_app` (allowed_hosts, cors_origins, body_timeout_s, max_concurrent_tokenize);
    `engine_options` to the Engine (the speculative drafter)."""
    from dsv41.engine.block_manager import BlockManager
    from dsv41.engine.engine import Engine
    from dsv41.server.app import create_app
    from dsv41.server.metrics import ServerMetrics
    from dsv41.server.scheduler import Scheduler

    config = model.config
    if kv_budget_bytes is None:
        kv_budget_bytes = free_memory_bytes(next(model.parameters()).device) // 2
    max_tokens = min(BlockManager.tokens_for_budget(config, kv_budget_bytes, max_batch), max_batch * config.max_seq_len)
    if max_tokens < config.max_seq_len:
        raise ConfigError(f"a KV budget of {kv_budget_bytes / 2**30:.3f} GiB holds {max_tokens} tokens, less than one "
                          f"sequence of the model's context ({config.max_seq_len}); raise --kv-budget-gib")
    engine = Engine(model, prefill_chunk=prefill_chunk, max_batch=max_batch, prefix_cache=prefix_cache,
                    max_tokens=max_tokens, **(engine_options or {}))
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, max_queue=max_queue, timeout_s=timeout_s or None, metrics=metrics)
    app = create_app(scheduler, tok, model_name=model_name, max_model_len=model.config.max_seq_len,
                     api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics, **app_options)
    return app, scheduler


def allowed_hosts_for(bind: str, option: str | None) -> list[str]:
    """--allowed-hosts, else the bound address plus the loopback names."""
    if option:
        return [h.strip() for h in option.split(",") if h.strip()]
    return sorted({bind, "127.0.0.1", "localhost", "::1"} - {"0.0.0.0", "::"})


class DrainingServer:
    """uvicorn.Server whose first SIGTERM / SIGINT drains the scheduler before uvicorn's own shutdown: admission
    stops at once, running streams may finish for `shutdown_timeout` s, then the rest end with an error event
    and [DONE]; uvicorn waits for those connections (a few seconds' margin) before it cancels anything."""

    def __new__(cls, config, scheduler, shutdown_timeout: float):
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                if not scheduler.draining:
                    log.info("signal %s: draining (up to %.0f s)", sig, shutdown_timeout)
                    scheduler.begin_drain(shutdown_timeout)
                super().handle_exit(sig, frame)

        return _Server(config)


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

    keys = args.api_key or [k for k in os.environ.get("DSV41_API_KEY", "").split(",") if k]
    if any(not k.strip() for k in keys):
        raise ConfigError("--api-key must not be empty")
    for name in ("max_batch", "max_queue", "max_body_bytes", "prefix_stride", "max_concurrent_tokenize",
                 "prefill_chunk"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.idle_prefill_chunk is not None and args.idle_prefill_chunk < 0:
        raise ConfigError(f"--idle-prefill-chunk must be >= 0 (0: off), got {args.idle_prefill_chunk}")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.timeout < 0 or (args.kv_budget_gib is not None and args.kv_budget_gib <= 0):
        raise ConfigError("--timeout must be >= 0 and --kv-budget-gib > 0")
    if args.shutdown_timeout < 0 or args.body_timeout <= 0:
        raise ConfigError("--shutdown-timeout must be >= 0 and --body-timeout > 0")
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
    from dsv41.engine.cli import build_speculative

    speculative = build_speculative(args, model, args.max_batch)  # ConfigError (exit 2) without a drafter
    chosen = {"overlap": args.overlap, "idle_prefill_chunk": args.idle_prefill_chunk,
              "static_prefill": args.static_prefill}
    engine_options = {**(speculative or {}), **{k: v for k, v in chosen.items() if v is not None}}

    prefix_cache = None
    if args.prefix_store:
        from dsv41.engine.prefix import PrefixCache
        from dsv41.engine.prefix_store import BackgroundWriter, PersistentStore, make_swa_pool

        try:
            pool = make_swa_pool(args.swa_pool)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # keyed by the weights' fingerprint; unit and snapshot writes (fsync, Redis) off the engine thread
        prefix_cache = PrefixCache.for_model(model, tok, PersistentStore(args.prefix_store), pool,
                                             stride=args.prefix_stride, writer=BackgroundWriter())
    name = args.served_model_name or (args.checkpoint.resolve().name if args.checkpoint else f"dsv41-{args.preset}")
    budget = int(args.kv_budget_gib * 2**30) if args.kv_budget_gib else None
    cors = [o.strip() for o in args.cors_origins.split(",") if o.strip()] if args.cors_origins else None
    app, scheduler = build_server(model, tok, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue,
                                  kv_budget_bytes=budget, timeout_s=args.timeout, api_key=keys or None,
                                  max_body_bytes=args.max_body_bytes, prefix_cache=prefix_cache,
                                  prefill_chunk=args.prefill_chunk, engine_options=engine_options,
                                  allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
                                  cors_origins=cors, body_timeout_s=args.body_timeout,
                                  max_concurrent_tokenize=args.max_concurrent_tokenize)
    engine = scheduler.engine
    if args.warm_up or (args.warm_up is None and engine.device.type == "cuda"):
        log.info("warm-up: kernels compiled for every prefill piece shape, every decode graph captured in %.1f s",
                 engine.warm_up())
    if not _is_loopback(args.host):
        log.warning("binding %s: reachable beyond this machine%s%s", args.host,
                    "" if keys else " and WITHOUT an API key",
                    "" if args.allowed_hosts else "; only Host headers naming loopback or the bound address are "
                                                  "accepted: pass --allowed-hosts with the names clients use")
    log.info("serving '%s' on http://%s:%d/v1 (max batch %d, queue %d, KV pools %.3f GiB)", name, args.host,
             args.port, args.max_batch, args.max_queue, scheduler.kv_capacity_bytes / 2**30)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    DrainingServer(config, scheduler, args.shutdown_timeout).run()
    if prefix_cache is not None and prefix_cache.store is not None:
        prefix_cache.store.close()
    return 0
