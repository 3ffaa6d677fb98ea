"""Speculative decoding vs plain decode on the same engine: tokens/s, GPU time per token, acceptance.

    python benchmarks/speculative.py                                   # H200: models/dsv41-small, oracle drafter
    python benchmarks/speculative.py --drafter dspark --checkpoint models/dsv41-small --text data/sample
                                                                       # the checkpoint's DSpark drafter
    python benchmarks/speculative.py --device cpu --preset tiny --batches 1 2 --prompt-len 16 \\
        --new-tokens 8                                                 # a smoke run without a GPU

For each batch size the same greedy requests (prompts of `--prompt-len` tokens, `--new-tokens` each) run
on a plain engine (CUDA graphs on a GPU) and on a speculative one (the static verification step of k + 1
positions and the drafter's proposal, both CUDA-graphed on a GPU, the verification-length scheduler over the
step-time curve the engine profiled at start-up, the cost model of `speculate`), each warmed up first as a
server starts (`Engine.warm_up`: every prefill shape compiled, every decode graph captured). Measured over
the decode phase (after every prompt's prefill): tokens/s, the seconds spent inside the drafter (host
seconds only unless --sync-drafter, which then costs the run its host/device overlap; "spec excluding
drafter" = what a free drafter would give — the oracle drafter is a second copy of the model and costs as
much as the main one), GPU kernel time per generated token (torch.profiler, over
`--profile-steps` steps) and the acceptance statistics; the outputs are checked equal (greedy is
lossless; a differing output is checked for a near tie at its first difference). With
--requests-per-slot R > 1, R × batch requests stream through max_batch = batch (finished rows refilled):
"steady" tokens/s is then measured while every slot is busy, without a closed batch's ragged tail. Writes
benchmarks/results/speculative-<date>-<dtype>[-<tag>].json, with the cost model's per-step timeline.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import to_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CHECKPOINT = Path(__file__).resolve().parents[1] / "models" / "dsv41-small"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TimedDrafter:
    """A drafter wrapper that adds up the seconds spent in propose / observe (synchronized when `sync` is)."""

    def __init__(self, drafter, sync, device_accept: bool = True):
        self.drafter, self.sync, self.seconds = drafter, sync, 0.0
        self.k = drafter.k
        self.features_at = getattr(drafter, "features_at", "output")
        self.pure_propose = getattr(drafter, "pure_propose", False)  # the engine's early proposal
        if hasattr(drafter, "observe_many"):  # the engine's batched hand-over, when the drafter has one
            self.observe_many = lambda *args: self._timed(drafter.observe_many, *args)
            self.observe_many_skips = getattr(drafter, "observe_many_skips", False)  # (its catch-up of long lags)
        if hasattr(drafter, "observe_many_device") and device_accept:  # the engine's acceptance on the device
            self.observe_many_device = lambda *args: self._timed(drafter.observe_many_device, *args)
            self.observed_more = drafter.observed_more
        if hasattr(drafter, "warm_up"):  # the engine captures the drafter's graphs at start-up
            self.warm_up = drafter.warm_up

    def _timed(self, fn, *args):
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args)
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out

    def features_wanted(self):
        return self.drafter.features_wanted()

    def start(self, seq_id):
        self.drafter.start(seq_id)

    def finish(self, seq_id):
        self.drafter.finish(seq_id)

    def observe(self, seq_id, tokens, features):
        return self._timed(self.drafter.observe, seq_id, tokens, features)

    def propose(self, seq_ids, last_tokens):
        return self._timed(self.drafter.propose, seq_ids, last_tokens)


WARM_UP_TOKENS = 32  # tokens per request of the untimed warm-up batch
STALL_S = 0.02  # a decode-window step slower than this is listed with what ran in it (`decode_run`'s "stalls")


def gc_collections() -> int:
    """Python garbage collections so far, every generation."""
    return sum(g["collections"] for g in gc.get_stats())


@contextlib.contextmanager
def cost_model_kept(engine):
    """Steps inside leave the engine's cost model as it was: steps timed under torch.profiler run ~2× slower on the
    host, and a cost model that kept them believed plain steps at 64 rows took 3.1 ms instead of 1.7 and drafted at
    a loss in the rounds after (H100, 2026-12-07: three of six rounds at 0.91× closed, the others 1.03–1.05×)."""
    kept = copy.deepcopy(engine.cost_model)
    try:
        yield
    finally:
        engine.cost_model = kept


def gpu_seconds(engine, steps: int, device: str) -> tuple[float | None, int]:
    """(kernel seconds, tokens emitted) over `steps` engine steps, from torch.profiler (None on the CPU)."""
    if not device.startswith("cuda"):
        return None, 0
    from torch.profiler import ProfilerActivity, profile

    before = engine.stats.decode_tokens
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if not engine.has_work():
                break
            engine.step()
        torch.cuda.synchronize()
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    return kernel_us / 1e6, engine.stats.decode_tokens - before


def decode_run(engine, prompts: list[list[int]], new_tokens: int, device: str, profile_steps: int,
               drafter: TimedDrafter | None, slots: int) -> dict:
    """The requests through `engine` (max_batch = slots; more requests than slots refill the batch as rows
    finish). First a warm-up: the first `slots` prompts for WARM_UP_TOKENS tokens (the first engine of a process
    compiles its kernels; each engine captures its graphs; a speculative engine's cost model measures the batch and
    keeps what it measured). Then three windows:
    * decode ("tokens_per_s"): from the step where the first `slots` requests all decode, to the end (the
      tail of a closed batch included);
    * "steady": the same start, up to the step after which fewer than `slots` rows are left (every slot busy);
    * "closed": from submitting the requests to the last token (their prefill and every output token: what a
      user waiting for the whole batch sees; the decode window starts later in a speculative run, whose rows
      decode faster while the last prompts prefill).
    Then the GPU time per token: the first `slots` prompts once more, `profile_steps` steps under
    torch.profiler (after the timed run, so both engines' windows start at the same point), the rest aborted."""
    from dsv41.engine.sampling import SamplingParams

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    steps_log: list[list] | None = None  # the timed run's steps (`logged_step`)

    def logged_step():
        """One engine step; in the timed run its wall time and what ran in it go to `steps_log`."""
        if steps_log is None:
            return engine.step()
        st = engine.stats
        forwards = lambda: st.speculative.forwards if st.speculative is not None else 0  # noqa: E731
        before = (st.prefill_pieces, st.decode_tokens, forwards(), len(engine.running))
        t = time.perf_counter()
        engine.step()
        steps_log.append([round(1e3 * (time.perf_counter() - t), 3), before[3], st.prefill_pieces - before[0],
                          st.decode_tokens - before[1], forwards() - before[2]])

    def start(batch, max_tokens=new_tokens):
        seqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in batch]
        while any(s.prefilling or s.next_token is None for s in seqs[:slots] if not s.finished) and engine.has_work():
            logged_step()  # every prefill of the first batch done: the decode phase starts
        sync()
        return seqs

    # warm-up: kernels compiled, the batch's decode graphs captured, and a cost model that has seen the batch decode
    # both ways (its first steps measure drafting; WARM_UP_TOKENS leave room for plain steps) — as a server has
    start(prompts[:slots], max_tokens=WARM_UP_TOKENS)
    while engine.has_work():
        engine.step()
    counted = ("static_prefill_runs", "prefill_pieces", "prefill_forwards", "decode_steps")
    before = {name: getattr(engine.stats, name) for name in counted}
    inner = getattr(engine.drafter, "drafter", engine.drafter)  # under TimedDrafter: the DSpark drafter's graphs
    captures = lambda: sum(getattr(g, "captures", 0) for g in (engine.static, engine.graphs, engine.vgraphs, inner)  # noqa: E731
                           if g is not None)
    captures0 = captures()
    steps_log = []
    t_submit = time.perf_counter()
    seqs = start(prompts)
    prefilled_s = time.perf_counter() - t_submit  # every prompt of the first `slots` in (the whole closed batch)
    ramp_steps = len(steps_log)
    engine.cost_model.timeline.clear()  # the decode window's steps from here (the decisions keep what they measured)
    drafter_s0 = drafter.seconds if drafter is not None else 0.0
    tokens0, t0 = sum(len(s.output) for s in seqs), time.perf_counter()
    steady = None  # (tokens, seconds) while every slot was busy
    peak = 0  # the most rows running after a step (a closed batch whose first rows finish before its last prompts
    # are admitted never has every slot busy: its "steady" window is then a step or two)
    stalls = []  # steps of more than STALL_S: what ran in them (graph captures, Python's garbage collection)
    step = 0
    while engine.has_work():
        n_captures, n_gc, t_step = captures(), gc_collections(), time.perf_counter()
        logged_step()
        dt = time.perf_counter() - t_step
        if dt > STALL_S:
            stalls.append({"step": step, "ms": round(1e3 * dt, 3), "rows": len(engine.running),
                           "graph_captures": captures() - n_captures, "gc_collections": gc_collections() - n_gc})
        step += 1
        peak = max(peak, len(engine.running))
        if steady is None and sum(not s.finished for s in seqs) < slots:
            sync()
            steady = (sum(len(s.output) for s in seqs) - tokens0, time.perf_counter() - t0)
    sync()
    t_end = time.perf_counter()
    timed_steps, steps_log = steps_log, None  # (the GPU-time profile below is not logged)
    window_steps = len(engine.cost_model.timeline)  # the cost model's steps of the decode window
    elapsed = t_end - t0
    tokens = sum(len(s.output) for s in seqs) - tokens0
    everything = sum(len(s.output) for s in seqs)
    drafter_s = (drafter.seconds - drafter_s0) if drafter is not None else 0.0
    gpu_s, gpu_tokens = None, 0
    if device.startswith("cuda") and profile_steps > 0:
        with cost_model_kept(engine):  # the profiled steps decide nothing after it (a next round's run)
            again = start(prompts[:slots])
            gpu_s, gpu_tokens = gpu_seconds(engine, profile_steps, device)
            for s in again:
                if not s.finished:
                    engine.abort(s)
    return {"outputs": [s.output for s in seqs], "decode_tokens": tokens, "decode_s": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed else None,
            "closed_s": t_end - t_submit, "closed_tokens": everything,
            "closed_tokens_per_s": everything / (t_end - t_submit),
            "steady_tokens": steady[0] if steady else None, "steady_s": steady[1] if steady else None,
            "steady_tokens_per_s": steady[0] / steady[1] if steady and steady[1] else None,
            "peak_running_rows": peak, "window_steps": window_steps,
            "stalls": stalls,  # steps of the decode window slower than STALL_S, with what ran in them
            # every step from submitting on: ms, rows before it, prefill pieces, tokens decoded, verification forwards
            # (the first `ramp_steps` until the closed batch's prompts are all prefilled)
            "steps": timed_steps, "ramp_steps": ramp_steps,
            "prefilled_s": prefilled_s,  # submit → the first `slots` prompts all prefilled (decode steps beside)
            # over the whole closed batch: runs, pieces, forwards and decode steps, graphs captured meanwhile
            "counts": {name: getattr(engine.stats, name) - before[name] for name in counted}
                      | {"graph_captures": captures() - captures0},
            "drafter_s": drafter_s,
            "tokens_per_s_excluding_drafter": tokens / (elapsed - drafter_s) if elapsed > drafter_s else None,
            "gpu_s_per_token": gpu_s / gpu_tokens if gpu_s is not None and gpu_tokens else None}


@torch.no_grad()
def divergences(model, prompts: list[list[int]], plain: list[list[int]], spec: list[list[int]]) -> list[dict]:
    """Each request whose speculative output differs from the plain one: its first differing position and the
    logits of a full (training) forward of the common prefix there — the gap between the plain and the
    speculative token relative to the logits' scale; a gap at rounding level is a near tie that the step
    shapes' different rounding (1-token step vs a k+1-position verification) decided differently."""
    device = next(model.parameters()).device
    out = []
    for i, (p, a, b) in enumerate(zip(prompts, plain, spec)):
        if a == b:
            continue
        j = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row = {"request": i, "position": j}
        if j < min(len(a), len(b)):
            logits = model(torch.tensor([p + a[:j]], device=device))[0, -1].float()
            top2 = logits.topk(2).values
            row.update(plain_token=a[j], spec_token=b[j], forward_argmax=int(logits.argmax()),
                       gap_over_scale=float((logits[a[j]] - logits[b[j]]).abs() / logits.abs().max()),
                       top2_gap_over_scale=float((top2[0] - top2[1]) / logits.abs().max()))
        out.append(row)
    return out


def parting(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per pair of outputs that differ, the first position where they do (the shorter one's length if one is the
    other's prefix)."""
    out = []
    for x, y in zip(a, b):
        if x != y:
            out.append(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))))
    return out


def text_prompts(data: Path, length: int, n: int) -> list[list[int]]:
    """n prompts of `length` tokens: windows of the corpus's validation documents, starting every length / 8 tokens
    (overlapping: `data/sample` holds 11 disjoint windows of 512, 87 of these), n of them spread evenly over all
    (cycled when there are fewer)."""
    from dsv41.train.data import load_corpus
    from dsv41.train.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    val = load_corpus(data, load_tokenizer(DEFAULT_TOKENIZER), Path.home() / ".cache" / "dsv41" / "tokens",
                      split="val")
    windows = []
    for i in range(len(val)):
        doc = val.doc(i).tolist()
        windows += [doc[s: s + length] for s in range(0, len(doc) - length + 1, max(1, length // 8))]
    if not windows:
        raise SystemExit(f"speculative: no validation document of {data} has {length} tokens")
    if n <= len(windows):
        return [windows[i * len(windows) // n] for i in range(n)]
    return [windows[i % len(windows)] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help=f"model directory (default {CHECKPOINT.name})")
    ap.add_argument("--preset", default=None, help="a random-init preset instead of a checkpoint (smoke runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--drafter", choices=["oracle", "dspark", "noisy"], default="oracle",
                    help="oracle: a copy of the model; dspark: the checkpoint's drafter; noisy: a corrupted oracle")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="draft tokens per verification (default: the DSpark block size, else 4)")
    ap.add_argument("--text", type=Path, default=None,
                    help="prompts = windows of the validation documents of this corpus folder (e.g. data/sample) "
                         "instead of random token ids (a trained drafter needs real text)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--speculate", choices=["auto", "always"], default="auto",
                    help="auto: the engine decodes plainly where its cost model says drafting does not pay")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests-per-slot", type=int, default=1,
                    help="requests = this × the batch, through max_batch = the batch: finished rows are refilled, "
                         "so the steady tokens/s is measured with every slot busy (1: one closed batch)")
    ap.add_argument("--profile-steps", type=int, default=8, help="steps under torch.profiler (GPU time)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="the model's (and drafter's) dtype (fp32: greedy outputs compare exactly but for near ties)")
    ap.add_argument("--sync-drafter", action="store_true",
                    help="synchronize the device around each drafter call, so drafter_s is its device time too "
                         "(the speculative run then loses the overlap of host and device: slower)")
    ap.add_argument("--plain-overlap", choices=["auto", "on", "off"], default="auto",
                    help="the plain engine's overlapped decode (auto: the engine's default, on with CUDA)")
    ap.add_argument("--spec-overlap", choices=["auto", "on", "off"], default="auto",
                    help="the speculative engine's overlap of the plain steps its cost model chooses (auto: the "
                         "engine's default, on with CUDA)")
    ap.add_argument("--no-prelaunch", action="store_true",
                    help="the speculative engine proposes and verifies at the start of each step, never at the end "
                         "of the one before (the comparison for chained verifications, Engine._chain)")
    ap.add_argument("--host-accept", action="store_true",
                    help="the speculative engine reads each verification before its acceptance, rollback and hand-over "
                         "(the comparison for the device's greedy acceptance, Engine._accept_on_device)")
    ap.add_argument("--spec-beside-prefill", type=int, default=None, metavar="ROWS",
                    help="the speculative engine decodes plainly in a step that also prefills when more than ROWS "
                         "rows decode (Engine(spec_beside_prefill=); default: no limit)")
    ap.add_argument("--no-projection", action="store_true",
                    help="the speculative engine decides at its decode rows' batch while prompts prefill or wait, "
                         "not at the batch they make (Engine.project_batch = False: the comparison)")
    ap.add_argument("--spec-first", action="store_true",
                    help="run the speculative engine before the plain one (default: plain first) — each engine is "
                         "built after the other has run, on the same model")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed runs of each engine, alternating which goes first (plain, spec, spec, plain, …: a "
                         "drift of the device's speed over the run — clocks, heat — falls on both alike); the "
                         "ratios are reported per round and as medians, the first round's runs in full (the "
                         "speculative engine's statistics and cost model: over every round)")
    ap.add_argument("--no-lean", action="store_true",
                    help="the speculative engine's plain steps always store their features for the drafter, also far "
                         "from its next draft (Engine.lean_plain = False: the comparison)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="after each engine's warm-up, move every object alive out of Python's garbage collection "
                         "(gc.freeze: shorter collections in the timed window; compares the stalls they cause)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("speculative: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    from dsv41 import load_config
    from dsv41.engine.engine import Engine, cast_for_engine
    from dsv41.engine.speculative import NoisyDrafter, SpeculativeError, build_drafter
    from dsv41.model.transformer import Transformer

    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    if args.preset:
        model = cast_for_engine(Transformer(load_config(args.preset)).init_weights(seed=0).to(args.device),
                                dtype).eval()
        source = f"preset {args.preset} (random init)"
    else:
        from dsv41.checkpoint import load_checkpoint

        path = args.checkpoint or CHECKPOINT
        model = cast_for_engine(load_checkpoint(path, device=args.device), dtype).eval()  # fp32 where the release is
        source = str(path)
    c = model.config
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    g = torch.Generator().manual_seed(0)
    report = {"benchmark": "speculative", "date": dt.date.today().isoformat(), "model": source,
              "drafter_s": "device-synchronized" if args.sync_drafter else "host seconds in drafter calls",
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "drafter": args.drafter, "speculate": args.speculate, "draft_tokens": args.draft_tokens,
              "dtype": args.dtype,
              "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"speculative-{report['date']}-{args.dtype}{'-' + args.tag if args.tag else ''}.json"
    if args.draft_tokens is None:
        args.draft_tokens = c.dspark_block_size or 4
        if args.drafter == "dspark":
            from dsv41.checkpoint.load import read_config

            d = (args.checkpoint or CHECKPOINT) / "dspark"
            args.draft_tokens = read_config(d).dspark_block_size if (d / "config.json").is_file() else 4
    report["draft_tokens"] = args.draft_tokens
    max_seq_len = args.prompt_len + args.new_tokens + args.draft_tokens + 8
    if args.requests_per_slot < 1:
        print("speculative: --requests-per-slot must be >= 1", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("speculative: --rounds must be >= 1", file=sys.stderr)
        return 2
    R = args.requests_per_slot
    report["requests_per_slot"] = R
    text = text_prompts(args.text, args.prompt_len, R * max(args.batches)) if args.text else None
    report["prompts"] = f"validation windows of {args.text}" if text else "random token ids"
    report["gc_freeze"] = args.gc_freeze

    def settle() -> None:
        """After an engine's warm-up: with --gc-freeze, everything alive so far leaves the collector's view (the
        engine's graphs, compiled kernels and model included), so a collection in the timed window walks only
        what the window allocates."""
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
    for B in args.batches:
        prompts = (text[:R * B] if text else
                   torch.randint(3, c.vocab_size, (R * B, args.prompt_len), generator=g).tolist())
        try:
            kind = "oracle" if args.drafter == "noisy" else args.drafter
            inner = build_drafter(kind, model, checkpoint=args.checkpoint, k=args.draft_tokens, max_sequences=B,
                                  max_seq_len=max_seq_len)
        except SpeculativeError as e:
            print(f"speculative: {e}", file=sys.stderr)
            return 2
        if args.drafter == "noisy":
            inner = NoisyDrafter(c.vocab_size, args.draft_tokens, base=inner, noise=0.3)
        drafter = TimedDrafter(inner, sync if args.sync_drafter else (lambda: None), not args.host_accept)
        if args.no_prelaunch:
            drafter.pure_propose = False
        warm_s = {}

        def build_plain() -> Engine:
            plain = Engine(model, max_batch=B, max_seq_len=max_seq_len, prefill_layers=None,
                           overlap={"auto": None, "on": True, "off": False}[args.plain_overlap])
            report["plain_overlap"] = plain.overlap
            warm_s["plain"] = plain.warm_up()  # every prefill shape compiled, every decode graph captured
            settle()
            return plain

        def build_spec() -> tuple[Engine, float]:
            t0 = time.perf_counter()
            engine = Engine(model, max_batch=B, max_seq_len=max_seq_len, drafter=drafter, speculate=args.speculate,
                            prefill_layers=None, overlap={"auto": None, "on": True, "off": False}[args.spec_overlap],
                            spec_beside_prefill=args.spec_beside_prefill)
            report["spec_overlap"] = engine.overlap
            report["spec_beside_prefill"] = args.spec_beside_prefill
            engine.project_batch = not args.no_projection
            report["project_batch"] = engine.project_batch
            engine.lean_plain = not args.no_lean
            report["lean_plain"] = engine.lean_plain
            report["prelaunch"] = drafter.pure_propose
            report["device_accept"] = hasattr(drafter, "observe_many_device")
            profile = time.perf_counter() - t0
            warm_s["speculative"] = engine.warm_up()
            settle()
            return engine, profile

        # each engine is built (and warmed up) just before its first run: the first one built compiles the kernels
        engines: dict[str, Engine] = {}
        profile_s = 0.0

        def timed(kind: str) -> dict:
            nonlocal profile_s
            if kind not in engines:
                if kind == "plain":
                    engines[kind] = build_plain()
                else:
                    engines[kind], profile_s = build_spec()
            result = decode_run(engines[kind], prompts, args.new_tokens, args.device, args.profile_steps,
                                drafter if kind == "spec" else None, B)
            if kind == "spec":  # kind, bucket, rows, ms, tokens per step of its decode window (not the profiled steps)
                result["timeline"] = [[k, b, rows, round(sec * 1e3, 3), n] for k, b, rows, sec, n
                                      in list(engines[kind].cost_model.timeline)[:result["window_steps"]]]
            return result

        first = ("spec", "plain") if args.spec_first else ("plain", "spec")
        rounds = []
        for i in range(args.rounds):  # ABBA: the order alternates round by round
            runs = {kind: timed(kind) for kind in (first if i % 2 == 0 else first[::-1])}
            rounds.append(runs)
        ratio = lambda a, b: a / b if a and b else None  # noqa: E731
        same = lambda a, b: sum(x == y for x, y in zip(a["outputs"], b["outputs"]))  # noqa: E731
        per_round = [{"first": next(iter(r)), "closed_speedup": ratio(r["plain"]["closed_s"], r["spec"]["closed_s"]),
                      "speedup": ratio(r["spec"]["tokens_per_s"], r["plain"]["tokens_per_s"]),
                      "plain_closed_s": r["plain"]["closed_s"], "spec_closed_s": r["spec"]["closed_s"],
                      "plain_tokens_per_s": r["plain"]["tokens_per_s"], "spec_tokens_per_s": r["spec"]["tokens_per_s"],
                      "lossless_requests": same(r["plain"], r["spec"]),
                      # where the outputs that differ part (bf16 near ties part late), and each engine against its
                      # own first round (an engine reused must decode its requests as before)
                      "parting_positions": parting(r["plain"]["outputs"], r["spec"]["outputs"]),
                      "plain_as_round_1": same(r["plain"], rounds[0]["plain"]),
                      "spec_as_round_1": same(r["spec"], rounds[0]["spec"])}
                     for r in rounds]
        base, spec = rounds[0]["plain"], rounds[0]["spec"]
        spec_engine = engines["spec"]
        report["order"] = "speculative first" if args.spec_first else "plain first"
        report["rounds"] = args.rounds
        st = spec_engine.stats.speculative
        plain_out, spec_out = base.pop("outputs"), spec.pop("outputs")
        run = {"batch": B, "requests": len(prompts), "plain": base, "speculative": spec,
               "lossless_requests": f"{per_round[0]['lossless_requests']}/{len(prompts)}",
               "divergences": divergences(model, prompts, plain_out, spec_out),
               "speedup": ratio(spec["tokens_per_s"], base["tokens_per_s"]),
               "steady_speedup": ratio(spec["steady_tokens_per_s"], base["steady_tokens_per_s"]),
               "closed_speedup": ratio(base["closed_s"], spec["closed_s"]),
               "speedup_excluding_drafter": ratio(spec["tokens_per_s_excluding_drafter"], base["tokens_per_s"]),
               "gpu_time_ratio_plain_over_spec": ratio(base["gpu_s_per_token"], spec["gpu_s_per_token"]),
               "mean_tokens_per_verification": st.mean_tokens_per_verification, "accepted_histogram": st.histogram,
               "length_histogram": st.length_histogram, "step_time_curve": spec_engine.step_time.to_dict(),
               "plain_steps": st.plain_steps, "verification_forwards": st.forwards, "prelaunched": st.prelaunched,
               "chained": st.chained, "chain_cancelled": st.chain_cancelled,
               "cost_model": spec_engine.cost_model.summary(),
               "timeline": spec.pop("timeline"),  # the first round's
               "verify_graphs": spec_engine.vgraphs.captures if spec_engine.vgraphs is not None else 0,
               "profile_s": profile_s, "warm_up_s": warm_s}
        if args.rounds > 1:  # every round's ratios (the full runs above are the first round's)
            run["rounds"] = per_round
            for key in ("closed_speedup", "speedup"):
                run[f"median_{key}"] = statistics.median(x[key] for x in run["rounds"] if x[key] is not None)
        report["runs"].append(run)
        path.write_text(to_json(report))  # after every batch: a run cut short keeps what it measured
        engines.clear()  # the engines, their drafter and runs go before the next batch's (the closures hold names)
        spec_engine = drafter = inner = rounds = runs = None
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"wrote {path}")
    print(f"{'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'x':>6} {'x steady':>9} {'x closed':>9} "
          f"{'x (no drafter)':>15} "
          f"{'GPU x':>6} {'tok/verif':>9} lossless")
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"  # noqa: E731
    for r in report["runs"]:
        print(f"{r['batch']:>5} {fmt(r['plain']['tokens_per_s']):>12} {fmt(r['speculative']['tokens_per_s']):>11} "
              f"{fmt(r['speedup']):>6} {fmt(r['steady_speedup']):>9} {fmt(r['closed_speedup']):>9} "
              f"{fmt(r['speedup_excluding_drafter']):>15} "
              f"{fmt(r['gpu_time_ratio_plain_over_spec']):>6} {r['mean_tokens_per_verification']:>9.2f} "
              f"{r['lossless_requests']}")
    for r in report["runs"]:
        if "rounds" in r:
            print(f"batch {r['batch']}, {len(r['rounds'])} rounds (first: "
                  f"{', '.join(x['first'] for x in r['rounds'])}): x closed "
                  f"{' '.join(fmt(x['closed_speedup']) for x in r['rounds'])} "
                  f"(median {fmt(r['median_closed_speedup'])}), "
                  f"x {' '.join(fmt(x['speedup']) for x in r['rounds'])} (median {fmt(r['median_speedup'])})")
    for r in report["runs"]:
        for name in ("plain", "speculative"):
            st = r[name]["stalls"]
            if st:
                print(f"batch {r['batch']} {name}: {len(st)} steps over {1e3 * STALL_S:.0f} ms, "
                      f"{sum(x['ms'] for x in st):.0f} ms in all ({sum(x['graph_captures'] > 0 for x in st)} "
                      f"with graph captures, {sum(x['gc_collections'] > 0 for x in st)} with garbage collections)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
