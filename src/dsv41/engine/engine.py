"""Engine: requests in, tokens out — `step()` = schedule → run → sample / postprocess.

The engine speaks token ids (tokenization happens at the edges). `generate` is the simple API;
`add_request` + `step` is what a server drives. Each step (`engine/scheduler.py` decides):
  1. one batched decode token for every running sequence past its prefill — the static decode
     step over the fixed pools, replayed from a CUDA graph on GPUs (`engine/graphs.py`), eager
     elsewhere;
  2. prefill pieces (encoder chunks, decoder bounded replay, each through some of its layers) of
     sequences still prefilling and of newly admitted ones, within the step's token budget and, while
     streams decode, its layer budget (`prefill_layers`: the eager prefill work a step may carry;
     `engine/prefill.py: PrefillJob`). Pieces of different sequences with one key (same kind, tokens and
     layers: the prompts of equal length that arrive together, an RL prompt group, an evaluation set) run
     as one batched forward (`PrefillJob.step_batch`) and count once against the layer budget — a prefill
     costs its eager forward's host time whatever its rows, so N short prompts no longer cost N forwards;
  3. sampling, stop checks, and the end of finished requests (prefix cache save, pages freed). When a
     step carries prefill pieces, the decode batch's tokens are sampled on the device and copied to the
     host without a wait, the pieces are launched (their host work runs while the device still decodes:
     the host-driven path builds its tensors without a stream sync, `block_manager.to_device`), and the
     tokens are read after them.
Every pool is allocated once (`BlockManager`); running out of pages preempts the newest sequence
to host memory (bit-exact swap) instead of reserving worst-case memory up front.
With a `drafter` (speculative decoding, `engine/speculative.py`, docs/speculative.md) step 1 becomes:
the drafter proposes k tokens per sequence, the main model verifies them in one forward through the
caches (the static verification step of k + 1 positions, CUDA-graphed like the decode step; the
host-driven forward near max_seq_len verifies per-row lengths chosen against the step-time curve
profiled at start-up), the accepted prefix (+ one token) is emitted and everything else is rolled back;
where the cost model says drafting does not pay at this batch size, the step decodes plainly instead.
With a drafter whose proposals draw nothing at random (`pure_propose`), a verification that leaves every
row going on launches the next step's proposal — and, when the next step is certain to verify the same rows,
its verification too — before its own bookkeeping (`_chain`): the device works while the host does that.
Greedy verifications accept on the device (`_accept_on_device`): the rollback, the drafter's hand-over and the
next proposal are queued behind the forward before the host reads the step, so the device never waits for it.
A request that fails alone (a sampler error, say) finishes with `error` set; the others go on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41.engine.block_manager import PAGE_ROWS, BlockManager, to_device
from dsv41.engine.cache import SequenceCache
from dsv41.engine.graphs import DecodeGraphs, batch_buckets, bucket, reachable_bounds
from dsv41.engine.prefill import PrefillJob, encode_prompt_images, encoder_only_supported, static_capture_fits
from dsv41.engine.prefix import PrefixCache, image_namespace
from dsv41.engine.runner import Capture, DecodeIO, Runner
from dsv41.engine.sampling import SamplingParams, make_generator, sample, token_logprobs
from dsv41.engine.scheduler import Scheduler
from dsv41.engine.sequence import Sequence, SequenceStatus
from dsv41.engine.speculative import (
    CostModel,
    Drafter,
    Proposal,
    SpeculativeStats,
    StepTimeCurve,
    VerifyRollback,
    choose_lengths,
    profile_step_time,
    verify,
)
from dsv41.engine.static_prefill import StaticPrefill
from dsv41.model.mhc import hc_pre
from dsv41.model.transformer import Transformer

log = logging.getLogger(__name__)

Request = Sequence  # the name earlier versions used


@dataclass
class StepOutput:
    request: Sequence
    token: int | None  # the token emitted this step (None when a stop id ended the request)
    finished: bool
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None


IDLE_PREFILL_CHUNK = 16384  # `Engine(idle_prefill_chunk=None)` on CUDA: the chunk of a step without decode rows
HOST_PREFILL_CHUNK = 2048  # `Engine(prefill_chunk=None)` where prefill runs on the host path
# `Engine(prefill_chunk=None)` with static prefill from CUDA graphs (and no drafter): whole runs of 128 tokens beside
# the decoding streams — 64 streams at 4K while four 32K prompts arrive, H100 2026-12-06: p99 gap 1.93x the unloaded
# p50 and first tokens after 0.8-3.1 s, against 5.56x and 1.9-10.5 s with one-layer host pieces of 512 tokens
# (benchmarks/results/decode_load-2026-12-06-h100-{static-128,layers1-512}.json)
STATIC_PREFILL_CHUNK = 128
_PENDING = -1  # a cache's token id that an in-flight step is still computing (`Engine(overlap=True)`)


@dataclass
class _InFlight:
    """A decode step launched and not yet emitted: its rows, logits, tokens sampled on the device, and the wait
    for their host copy; rows[i] = the row of seqs[i] in that step (rows that ended since are left out)."""

    seqs: list[Sequence]
    logits: Tensor
    tokens: Tensor
    wait: Callable[[], list[int]]
    rows: list[int] = field(default_factory=list)
    # after `wait`: step row → (logprob, top alternatives) of the rows that asked, computed at launch (the
    # logits buffer holds the next step's logits by the time the tokens are read)
    logprobs: Callable[[], dict[int, tuple[float, list[tuple[int, float]]]]] = lambda: {}

    def __post_init__(self) -> None:
        if not self.rows:
            self.rows = list(range(len(self.seqs)))


@dataclass
class _Prelaunched:
    """The next verification's proposal, launched at the end of the step before it (`Engine._chain`), and what it
    was made from: the rows and their cached tokens. The next step uses it only if both are unchanged (anything
    that moves a row — a plain step, and with it the drafter's catch-up — changes its count; the anchors are the
    last emitted tokens either way); otherwise it proposes again."""

    ids: list[int]
    n_tokens: list[int]
    proposal: Proposal
    rows: list[int] | None = None  # the proposal's rows of these ids (None: all, in order)


@dataclass
class _Chained:
    """The next verification, launched at the end of the step before it (`Engine._chain`): its rows, their
    first block positions, the proposal and its drafts on the device, and the step's logits. The next `step`
    resolves it (`_chained_step`) or, when its rows changed, undoes it (`_cancel_chain`)."""

    seqs: list[Sequence]
    starts: list[int]
    proposal: Proposal
    drafts: Tensor
    logits: Tensor


@dataclass
class _Accepted:
    """A verification's greedy acceptance computed on the device (`Engine._accept_on_device`): each row's keep
    count (accepted drafts + 1) and next pending token, on the device; `wait` gives the host, in one copy, per row
    the drafts the step ran, whether the proposal's ids were valid, the argmax of each verified position and the
    keep count."""

    keep: Tensor
    anchors: Tensor
    wait: Callable[[], tuple[list[list[int]], list[bool], list[list[int]], list[int]]]


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_pieces: int = 0
    prefill_tokens: int = 0
    prefill_layer_passes: int = 0  # Σ over pieces of the layers each ran
    prefill_forwards: int = 0  # host-driven prefill forwards (a batched group of pieces is one)
    static_prefill_runs: int = 0  # prefill runs (whole chunks, decoder replays) from static steps (`static_prefill`)
    preemptions: int = 0
    failures: int = 0
    overlapped_steps: int = 0  # decode steps launched before the previous one's tokens were read (overlap)
    speculative: SpeculativeStats | None = None  # acceptance counters and histogram when speculating
    # wall seconds by phase of the steps with decode rows (and the emission of prefills' first tokens), summed
    # over steps (`Engine.phase_ms`):
    # schedule; prepare (the step's inputs filled on the host and sent); launch (graph replay or eager forward
    # called — on a GPU its launch, not its run); sample (sampling queued and the tokens waited for: on a GPU this
    # holds the step's device time); emit (outputs, finishes)
    host_s: dict[str, float] = field(default_factory=dict)


def fp32_weights(model: Transformer) -> list[torch.nn.Parameter]:
    """Weights the model only ever multiplies in fp32: the head, the routers, the ratio > 1 compressors, and
    what the release stores in fp32 (`checkpoint.release_format`: mHC's hc_*_fn / base / scale — the mHC
    kernel splits hc_fn into three bf16 planes to keep its fp32 precision — and the attention sinks; the
    router biases keep fp32 on their own, `Gate._apply`)."""
    return [model.head.weight] + [w for layer in model.layers for w in block_fp32_weights(layer)]


def block_fp32_weights(block) -> list[torch.nn.Parameter]:
    """`fp32_weights` of one Block (a DSpark stage too): its router, its ratio > 1 compressor, its attention
    sink and its mHC coefficients."""
    weights = [block.ffn.gate.weight]
    comp = getattr(block.attn, "compressor", None)
    if comp is not None and comp.ratio > 1:
        weights += [comp.wkv.weight, comp.wgate.weight]
    weights.append(block.attn.attn_sink)
    weights += [getattr(block, f"hc_{which}_{part}") for which in ("attn", "ffn") for part in ("fn", "base", "scale")]
    return weights


def cast_for_engine(model: Transformer, dtype: torch.dtype) -> Transformer:
    """`model` in `dtype` (in place) but for its `fp32_weights`, which keep their fp32 values exactly (a plain
    `.to(dtype)` would round them before the engine upcasts them again). Returns the model."""
    kept = [(w, w.data) for w in fp32_weights(model)]
    model.to(dtype)
    for w, data in kept:
        w.data = data
    return model


DENSE_EXTRA_FLOPS = 4e9  # the most FLOPs the dense MoE dispatch may add over the routed ones (`dense_piece_tokens`)


def dense_piece_tokens(moe) -> int:
    """The most tokens a forward may have for the dense MoE dispatch (every expert on every token, the shared one
    fused in: `MoE.fuse_dense`) to cost less than the grouped one in a CUDA graph: its E − k extra experts per
    token add 6·dim·inter FLOPs each, and up to DENSE_EXTRA_FLOPS (~6 µs of bf16 matmul on an H100 / H200) cost
    less than the ~12 kernels of the grouped dispatch it saves (sort, counts, gathers, three grouped products,
    the scatter back, the shared expert's four). `small` (E = 8, k = 2, dim 384, inter 256): 1,130 tokens — the
    decoder replay and the pieces beside decoding streams; at the release's widths (E = 256): none."""
    dim, inter = moe.experts.dim, moe.experts.inter_dim
    return int(DENSE_EXTRA_FLOPS // ((moe.n_routed - moe.topk) * 6 * dim * inter)) if moe.n_routed > moe.topk else 0


def prefill_defaults(prefill_chunk: int | None, prefill_layers: int | str | None, static_prefill: bool,
                     graphs: bool, drafter: bool) -> tuple[int, int | None]:
    """`Engine`'s prefill_chunk (None) and prefill_layers ("auto") beside decoding streams: whole runs of
    STATIC_PREFILL_CHUNK tokens where static prefill replays them from CUDA graphs and no drafter's jobs leave it
    (`drafter`: a drafter whose features only the host path captures — encoder layers, or exact prefill —, where a
    short whole run costs ~820 launches); else HOST_PREFILL_CHUNK-token runs in 4-layer pieces. Given values are
    kept."""
    graphed_runs = static_prefill and graphs and not drafter
    if prefill_chunk is None:
        prefill_chunk = STATIC_PREFILL_CHUNK if graphed_runs else HOST_PREFILL_CHUNK
    if prefill_layers == "auto":
        prefill_layers = None if graphed_runs else 4
    return prefill_chunk, prefill_layers


def layout_for_graphs(model: Transformer, decode_rows: int) -> None:
    """What an engine with CUDA graphs sets on its model (fewer kernels per layer; the same function): each
    attention's wq_a and wkv as one matrix (`Attention.fuse_projections`), and on its MoE layers the dense dispatch
    for decode steps of up to `decode_rows` tokens where experts are few (E ≤ 4k) and for forwards of up to
    `dense_piece_tokens`, with the shared expert fused in (`MoE.fuse_dense`). Benchmarks that run the engine's
    pieces without an `Engine` (peer_decode's `StaticPrefill`) call it too."""
    for layer in model.layers:
        layer.attn.fuse_projections()
    for moe in model.moe_layers():
        if moe.n_routed <= 4 * moe.topk:
            moe.dense_tokens = max(moe.dense_tokens, decode_rows)
        moe.dense_tokens = max(moe.dense_tokens, dense_piece_tokens(moe))
        if moe.dense_tokens:
            moe.fuse_dense()


def keep_in_fp32(weights: list[torch.nn.Parameter]) -> None:
    """Weights a model only multiplies in fp32 (`fp32_weights`, `dspark_drafter.drafter_fp32_weights`) stored in
    fp32, in place — the same values, one cast per use fewer (a decode step launches ~40 kernels less)."""
    for w in weights:
        if w.dtype != torch.float32:
            w.data = w.data.float()


class Engine:
    def __init__(self, model: Transformer, *, prefill_chunk: int | None = None, max_batch: int = 64,
                 token_budget: int | None = None, prefill_layers: int | str | None = "auto",
                 exact_prefill: bool = False, prefix_cache: PrefixCache | None = None, max_seq_len: int | None = None,
                 max_tokens: int | None = None, cuda_graphs: bool | None = None, graph_min_entries: int = 1024,
                 page_rows: int = PAGE_ROWS, drafter: Drafter | None = None, step_time: StepTimeCurve | None = None,
                 speculate: str = "auto", batch_prefill: bool = True, overlap: bool | None = None,
                 idle_prefill_chunk: int | None = None, static_prefill: bool | None = None,
                 spec_beside_prefill: int | None = None):
        """max_seq_len bounds one sequence (default: the config's); max_tokens sizes the global-KV
        pools for all sequences together (default: min(max_batch·max_seq_len, 2^20), at least
        max_seq_len); prefill_chunk = prompt tokens per prefill run while sequences decode (default: 128 where
        static prefill runs from CUDA graphs without a drafter — STATIC_PREFILL_CHUNK —, else 2048); token_budget =
        tokens per step (default prefill_chunk + max_batch × a decoding row's tokens: 1, k + 1 with a drafter);
        prefill_layers = layer passes of prefill per step while
        sequences decode (None: whole runs; "auto", the default: whole runs where static prefill runs from CUDA
        graphs without a drafter, else 4), which bounds the eager work a step adds to the streams' token gaps;
        cuda_graphs: replay decode steps from CUDA graphs (default: on CUDA devices); page_rows =
        entries per page of the global-KV pools. drafter: speculative decoding (off when None);
        step_time: its step-time curve (default: profiled here on the static steps, `profile_step_time`);
        speculate: "auto" — a step decodes plainly when the measured speculative steps at this batch size
        emit fewer tokens per second than plain ones (`CostModel`; the drafter catches up on those
        tokens later) — or "always". spec_beside_prefill (with a drafter): the most decoding rows a step that
        also prefills verifies with; above it such a step decodes plainly, so the prompts it carries wait less
        (None, the default: no limit). An experiment for issue 19's closed batch of 64, whose speculative engine
        prefilled its last prompts 0.2 s later than the plain one (H100, 2026-12-07); not yet measured on a GPU
        (`benchmarks/speculative.py --spec-beside-prefill`). idle_prefill_chunk: the chunk (and token budget) of a
        step without decode rows (`Scheduler`: a lone prompt prefills in few big chunks; default on CUDA
        max(prefill_chunk, 16384) — a chunk's host cost is its launches, not its tokens — off elsewhere; 0: off).
        batch_prefill: prefill
        pieces with one key share a forward (and the layer budget; not with a drafter); False runs every piece
        alone (the comparison). overlap: a decode step
        launches the next one before it reads its own tokens (`_overlapped_step`; default: on CUDA devices, where
        the host's bookkeeping then runs beside the device — 0.34× → 0.50× the graphed dense peer at 64 × 4K on the
        H200; with a drafter the plain steps its cost model chooses overlap, verification steps never — on the
        H100 on 2026-12-07, in one call, a batch of 64 that went plain stepped in 1.53 ms instead of 2.3 and
        batch 1 drafting kept its 1.91×: `results/speculative-2026-12-07-h100-bf16-{b64-long-overlap,b64-long,
        b1-overlap}.json`).
        static_prefill: a prefill run of a plain prompt that goes through all its layers in one piece (every run of
        an idle step, and beside decoding streams when prefill_layers is None) runs from
        static steps over power-of-two shapes (`engine/static_prefill.py`), replayed from CUDA graphs when
        cuda_graphs is on — default: on with CUDA graphs (a lone 32K prompt's first token 73 → 40 ms on the H100),
        off elsewhere."""
        if speculate not in ("auto", "always"):
            raise ValueError(f"speculate must be 'auto' or 'always', got {speculate!r}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if spec_beside_prefill is not None and spec_beside_prefill < 0:
            raise ValueError(f"spec_beside_prefill must be >= 0 or None, got {spec_beside_prefill}")
        if isinstance(prefill_layers, str) and prefill_layers != "auto":
            raise ValueError(f"prefill_layers must be a count, None or 'auto', got {prefill_layers!r}")
        self.model = model.eval()
        self.config = c = model.config
        self.device = next(model.parameters()).device
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.runner = Runner(model)
        if static_prefill is None:
            static_prefill = use_graphs and encoder_only_supported(self.runner)
        # a drafter's prompts prefill from static steps too when its features come from decoder layers (the
        # replay captures them) and prefill is encoder-only
        host_features = drafter is not None and not static_capture_fits(c, drafter.features_wanted(), exact_prefill)
        prefill_chunk, prefill_layers = prefill_defaults(prefill_chunk, prefill_layers, bool(static_prefill),
                                                         use_graphs, host_features)
        self.prefill_chunk, self.max_batch, self.exact_prefill = prefill_chunk, max_batch, exact_prefill
        self.prefix_cache = prefix_cache
        self.max_seq_len = int(max_seq_len or c.max_seq_len)
        max_tokens = max(self.max_seq_len, max_tokens or min(self.max_seq_len * max_batch, 1 << 20))
        self.pools = BlockManager(c, self.device, max_slots=max_batch, max_tokens=max_tokens,
                                  max_seq_len=self.max_seq_len, page_rows=page_rows)
        self.drafter = drafter
        self.feature_ring = None  # (slots + 1, W, n, dim): the drafter's features of plainly decoded tokens
        self.vio = self.vgraphs = None  # the static verification step (T = k + 1) and its graphs
        wanted: tuple[int, ...] = ()
        if drafter is not None:
            if not 1 <= drafter.k < c.window_size:
                raise ValueError(f"drafter proposes k = {drafter.k}; 1 <= k < window_size = {c.window_size} needed")
            wanted, at = tuple(drafter.features_wanted()), getattr(drafter, "features_at", "output")
            self.feature_ring = torch.zeros(self.pools.dummy_slot + 1, c.window_size, len(wanted), c.dim,
                                            device=self.device)
            self.vio = DecodeIO(c, self.pools, max_batch, drafter.k + 1, capture_layers=wanted, capture_at=at,
                                projections=True, rollback=True)
            if use_graphs:
                self.vgraphs = DecodeGraphs(self.runner, self.vio, min_entries=graph_min_entries)
            # each row's pending token, the proposal's anchor: a pinned host mirror and its device twin
            self._anchors = torch.zeros(max_batch, dtype=torch.long, pin_memory=self.device.type == "cuda")
            self._anchors_dev = torch.zeros(max_batch, dtype=torch.long, device=self.device)
            # greedy acceptance on the device (`_accept_on_device`): each row's verification length in, and out in
            # one copy per row the drafts k, the invalid-ids flag, the argmax of the k + 1 positions, the keep count
            cuda = self.device.type == "cuda"
            self._lengths = torch.zeros(max_batch, dtype=torch.long, pin_memory=cuda)
            self._lengths_dev = torch.zeros(max_batch, dtype=torch.long, device=self.device)
            self._accepted_host = torch.zeros(max_batch, 2 * drafter.k + 3, dtype=torch.long, pin_memory=cuda)
            self._accepted_event = torch.cuda.Event() if cuda else None
            self._draft_positions = torch.arange(drafter.k, device=self.device)
        # the decode batch's sampled tokens, copied here without a wait while prefill pieces launch (`step`)
        self._sampled_host = torch.zeros(max_batch, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.io = DecodeIO(c, self.pools, max_batch, capture_layers=wanted,
                           capture_at=getattr(drafter, "features_at", "output"), feature_ring=self.feature_ring)
        self.graphs = DecodeGraphs(self.runner, self.io, min_entries=graph_min_entries) if use_graphs else None
        keep_in_fp32(fp32_weights(model))
        if use_graphs:  # decode-sized forwards and small prefill pieces: every expert on every token (fewer kernels)
            layout_for_graphs(model, max_batch * (drafter.k + 1 if drafter else 1))
        # before the start-up profile below: its static steps are timed by phase too
        self.stats = EngineStats(speculative=SpeculativeStats(k=drafter.k) if drafter is not None else None)
        self.step_time = step_time
        self.speculate = speculate
        self.spec_beside_prefill = spec_beside_prefill
        # speculate="auto": while prompts prefill or wait, decide at the bucket of the batch they make (the benchmarks'
        # comparison switches it off)
        self.project_batch = True
        self._pieces_behind = 0  # decode steps still to measure as `mixed` (prefill pieces queued before them)
        self.cost_model = CostModel(lambda n: self.step_time(n))  # speculate="auto"; the curve is profiled below
        self._drafter_seen: dict[int, int] = {}  # sequence id → tokens the drafter has observed
        # lean plain steps (`_lean`): sequence id → the first position whose features the ring holds since the row's
        # last lean step (the positions before it, back to what the drafter has seen, have none anywhere)
        self._ring_from: dict[int, int] = {}
        self._ring_wanted = False  # the last decision was to draft, but a row's ring was not ready (`_decides_plain`)
        self.lean_plain = drafter is not None  # the benchmarks' comparison switches it off
        self.buckets = batch_buckets(max_batch)  # the padded batch sizes of the static steps (their graphs)
        decode_tokens = 1
        if drafter is not None:
            decode_tokens = drafter.k + 1
            if self.step_time is None:  # the start-up profile the verification-length scheduler plans with
                self.step_time = profile_step_time(self._timed_static_step, self.pools, c, k=drafter.k,
                                                   batch_sizes=self.buckets)
            warm_up = getattr(drafter, "warm_up", None)
            if warm_up is not None:  # the drafter's graphs of every bucket now, not mid-run (DSparkDrafter.warm_up)
                warm_up(self.buckets)
            self.stats.host_s.clear()  # the profile's steps are not the engine's
        self.batch_prefill = batch_prefill and drafter is None  # a drafter's jobs capture features: run alone
        # default: on CUDA (with a drafter too since 2026-12-07: measured on the H100, see the docstring)
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._inflight: _InFlight | None = None  # the decode step launched and not yet emitted (overlap)
        # two pinned buffers for the in-flight steps' tokens: step t + 1 copies into one while step t's are read
        self._inflight_host = [torch.zeros(max_batch, dtype=torch.long, pin_memory=self.device.type == "cuda")
                               for _ in range(2)] if self.overlap else []
        self._launches = 0
        if idle_prefill_chunk is None:
            idle_prefill_chunk = max(prefill_chunk, IDLE_PREFILL_CHUNK) if self.device.type == "cuda" else 0
        if idle_prefill_chunk < 0:
            raise ValueError(f"idle_prefill_chunk must be >= 0 (0: off), got {idle_prefill_chunk}")
        self.static = None  # StaticPrefill: the whole prefill runs of plain prompts (`PrefillJob(static=)`)
        if static_prefill:
            top = max(prefill_chunk, idle_prefill_chunk)
            self.static = StaticPrefill(self.runner, self.pools, chunk=top, graphs=use_graphs,
                                        min_entries=graph_min_entries)
        # the default budget: a prefill chunk beside a full batch of decoding rows, each claiming its decode tokens
        # (k + 1 with a drafter: with max_batch only, no prompt got in once budget / (k + 1) rows decoded)
        budget = token_budget or prefill_chunk + max_batch * decode_tokens
        self.scheduler = Scheduler(self, max_batch=max_batch, token_budget=budget, decode_tokens=decode_tokens,
                                   prefill_layers=prefill_layers,
                                   batch_pieces=batch_prefill, idle_chunk=idle_prefill_chunk or None)
        self._ids = itertools.count()
        self._drafting: set[int] = set()  # ids of the sequences the drafter has started
        self._next_proposal: _Prelaunched | None = None  # the next verification's proposal, launched early
        self._chained: _Chained | None = None  # the next verification, launched at the end of the last step

    # ------------------------------------------------------------------ request API
    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    exact_prefill: bool | None = None, namespace: str | bytes | None = None,
                    images: list | None = None) -> Sequence:
        """Queue a request; `namespace` keys its prefix-cache entries (a tenant never hits another's).
        `images` (`image_processor.ImageInput`, in order) fill the prompt's image spans (runs of
        `image_token_id`, `image_processor.expand_placeholders`): they are encoded here (the vision
        stage, `prefill.encode_prompt_images`), enter at prefill, and their content hashes join the
        prefix-cache namespace. Raises ValueError (`ImageError`) when they do not fit the prompt."""
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_seq_len={self.max_seq_len}")
        prompt_images = None
        if images:
            prompt_images = encode_prompt_images(self.model, list(prompt), images)
            namespace = image_namespace(namespace, prompt_images.hashes)
        elif self.config.vision_enabled and self.config.image_token_id in prompt:
            raise ValueError(f"the prompt holds image tokens (id {self.config.image_token_id}) but no images")
        params = params or SamplingParams()
        seq = Sequence(next(self._ids), list(prompt), params,
                       self.exact_prefill if exact_prefill is None else exact_prefill,
                       generator=make_generator(params.seed), namespace=namespace,
                       images=prompt_images)
        self.scheduler.add(seq)
        return seq

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    WARM_UP_PROMPTS = ((1,), (17, 17), (160,))  # prompt lengths, one group at a time (a group arrives at once)

    @torch.no_grad()
    def warm_up(self, groups: tuple[tuple[int, ...], ...] = WARM_UP_PROMPTS, beside: bool = True,
                decode_graphs: bool = True) -> float:
        """Run throwaway prompts through prefill and two decode steps each, so that every kernel variant a live
        step needs is compiled (Triton) or captured (CUDA graphs) before the first real request — each is seconds
        that a live server would otherwise spend with every stream waiting (decode_load, 2026-12-06: steps of
        6.2 s and 4.9 s). Variants follow the piece's kind and shape: 1 token, an odd count (two prompts at once:
        a batched piece) and 16·k (the default groups), the first chunk of a prompt or a continued one, a whole
        run or one cut between layers. With static prefill the groups run twice: on the host path — the path of
        every piece beside decoding streams, which an idle engine's prompts never take — then through
        `StaticPrefill`. `beside` (max_batch ≥ 2): then a prompt of prefill_chunk + 17 tokens arrives while
        another request decodes — the loaded path: two chunks (the second reads the first's window ring), layer
        pieces (`prefill_layers`) and odd counts next to a decode batch. The prefix cache is bypassed; the
        counters in `stats` include the warm-up. `decode_graphs`: then every decode step's CUDA graph is
        captured too (`capture_decode_graphs`). Needs an idle engine; returns the seconds it took."""
        if self.has_work():
            raise RuntimeError("Engine.warm_up needs an idle engine (no request waiting or running)")
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(0)

        def prompt(n: int, room: int = 3) -> list[int]:
            n = max(1, min(n, self.max_seq_len - room))  # room for the tokens it decodes
            return torch.randint(3, self.config.vocab_size, (n,), generator=g).tolist()

        prefix_cache, self.prefix_cache = self.prefix_cache, None
        static = self.static
        try:
            for path in (None, static) if static is not None else (None,):  # the host path, then the static one
                self.static = path  # read when a request is admitted (its `PrefillJob`)
                for group in groups:
                    for n in group:
                        self.add_request(prompt(n), SamplingParams(max_tokens=2))
                    while self.has_work():
                        self.step()
            self.static = static
            if beside and self.max_batch >= 2 and self.max_seq_len > 40:
                # long enough to decode beside the other's every piece (two chunks and the replay, a layer each)
                n_decode = min(self.max_seq_len - 20, 4 * self.config.n_layers + 16)
                stream = self.add_request(prompt(17, room=20), SamplingParams(max_tokens=n_decode))
                while not stream.output and not stream.finished:  # its prefill done: it decodes
                    self.step()
                arriving = self.add_request(prompt(self.prefill_chunk + 17), SamplingParams(max_tokens=2))
                while not arriving.finished and not stream.finished:
                    self.step()
                if not stream.finished:
                    self.abort(stream)
                while self.has_work():
                    self.step()
        finally:
            self.prefix_cache, self.static = prefix_cache, static
        if decode_graphs:
            self.capture_decode_graphs()
        return time.perf_counter() - t0

    @torch.no_grad()
    def capture_decode_graphs(self) -> int:
        """Capture now every CUDA graph a decode step can replay: the plain step, and with a drafter the
        verification step and its rollback, at every batch bucket and every entry-bound key a sequence of up to
        max_seq_len tokens reaches (`graphs.reachable_bounds`). Otherwise each is captured the first time a step
        needs it — a closed batch's rows finishing one by one, or its longest row's entries passing a power of
        two — and every stream waits meanwhile: on the H100 on 2026-12-07, 7 of them in a closed batch of 64 took
        0.83 s of the plain engine's 2.7 s of decoding, 9 took 1.1 s of the speculative one's
        (`results/speculative-2026-12-07-h100-bf16-b64-closed.json`, "stalls"). Captures run on padding rows
        only, the smallest shapes first; a no-op without graphs (the CPU). A capture that fails (out of memory at
        the largest bounds, say) ends the warm-up's captures, not the graphs: the rest are captured when a step
        first needs them, as before. Returns the graphs captured."""
        every = [g for g in (self.graphs, self.vgraphs) if g is not None]
        before = sum(g.captures for g in every)
        ratios = {s: pool.ratio for s, pool in self.pools.sources.items()}
        try:
            for graphs in every:
                keys = reachable_bounds(ratios, self.max_seq_len + graphs.io.T, graphs.min_entries)
                lean = (False, True) if graphs is self.graphs and self._lean_possible() else (False,)
                for n_max in keys + ([None] if graphs is self.vgraphs else []):  # None: the rollback's graph
                    for Bb in self.buckets:
                        for variant in lean if n_max is not None else (False,):
                            graphs.ensure(Bb, n_max, lean=variant)
        except RuntimeError as err:
            log.warning("warm-up: a decode graph's capture failed (%s); the %d captured stay, the rest are captured "
                        "when first needed", err, sum(g.captures for g in every) - before)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        return sum(g.captures for g in every) - before

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One engine step: the scheduled decode batch, then the scheduled prefill pieces. With `overlap`, a
        decode-only step's tokens are emitted by the next call (which has launched the step after it first)."""
        resolved: list[StepOutput] = []
        if self._chained is not None:
            if self._chain_holds(self._chained):
                return self._chained_step()
            self._cancel_chain()
        if self._inflight is not None:
            if self._can_continue(self._inflight):
                return self._overlapped_step()
            inflight, self._inflight = self._inflight, None
            resolved = self._resolve(inflight, launched_next=False)
        return resolved + self._step()

    def _step(self) -> list[StepOutput]:
        t_schedule = time.perf_counter()
        batch = self.scheduler.schedule()
        self._phase("schedule", t_schedule)
        self.stats.steps += 1
        self.stats.preemptions += len(batch.preempted)
        outputs: list[StepOutput] = []
        pending = None  # the decode batch's sampled tokens on their way to the host, while the pieces launch
        if batch.decode:
            t0 = time.perf_counter()
            overlapped = self.overlap and not batch.prefill and self._overlappable(batch.decode)
            drafts = self.drafter is not None and not self._decides_plain(batch.decode) and not (
                batch.prefill and self.spec_beside_prefill is not None
                and len(batch.decode) > self.spec_beside_prefill)  # then the prompts in this step wait less
            if drafts:
                outputs.extend(self._speculate(batch.decode))
            elif self.drafter is not None and not overlapped and not batch.prefill:
                outputs.extend(self._plain_step(batch.decode))  # timed for the cost model
            else:
                if overlapped:  # with a drafter: the cost model chose plain steps (`_decides_plain`)
                    self._inflight = self._launch(batch.decode)
                    if self._inflight is not None:  # emitted by the next call
                        self._add_decode_time(batch.decode, time.perf_counter() - t0)
                        return outputs
                    logits = self.io.logits[:len(batch.decode)]  # sampling failed at launch: find the row(s) now
                    outputs.extend(self._emit(batch.decode, logits))
                    self._add_decode_time(batch.decode, time.perf_counter() - t0)
                    return outputs
                if self.drafter is not None:  # a plain step beside prefill pieces: the pieces' launches overlap it
                    self._count_plain(len(batch.decode))  # as in a plain engine (not timed: the pieces share it)
                logits = self._decode(batch.decode)
                if batch.prefill:
                    # overlap: the pieces' host work (their kernel launches) runs while the device still
                    # decodes; the tokens are read after the pieces are queued (`_launch_sample`)
                    t_sample = time.perf_counter()
                    pending = (logits, self._launch_sample(batch.decode, logits))
                    self._phase("sample", t_sample)
                else:
                    outputs.extend(self._emit(batch.decode, logits))
            self._add_decode_time(batch.decode, time.perf_counter() - t0)
        prefill_outputs: list[StepOutput] = []
        self._run_pieces(batch.prefill, prefill_outputs)
        if batch.prefill:
            self._pieces_behind = 2
        if pending is not None:
            t0 = time.perf_counter()
            logits, tokens = pending
            sampled = tokens()
            self._phase("sample", t0)
            outputs.extend(self._emit(batch.decode, logits, sampled))
            self._add_decode_time(batch.decode, time.perf_counter() - t0)
        outputs.extend(prefill_outputs)
        return outputs

    # ------------------------------------------------------------------ overlapped decode
    def _overlappable(self, seqs: list[Sequence]) -> bool:
        """Whether the step after these rows' next one may be launched before their tokens are known: each row's
        next position fits the context (pages: `_can_continue`). Rows that ask for log-probabilities have them
        computed on the device at launch (`_launch`), before the next step overwrites the logits."""
        return all(s.num_cached_tokens + 1 < self.max_seq_len for s in seqs)

    def _can_continue(self, inflight: _InFlight) -> bool:
        """The in-flight rows are the whole next batch: nothing waits, nothing prefills, no row left, and each
        row's next token needs no new page (then the scheduler would schedule exactly these rows, in order)."""
        running = self.scheduler.running
        return (not self.scheduler.waiting and len(running) == len(inflight.seqs)
                and all(s.status is SequenceStatus.RUNNING and s.job is None for s in inflight.seqs)
                and self._overlappable(inflight.seqs) and not any(self.pages_to_grow(s, 1) for s in inflight.seqs)
                and (self.drafter is None or self._decides_plain(inflight.seqs)))

    def _decides_plain(self, seqs: list[Sequence]) -> bool:
        """With a drafter: whether the next step of these rows is a plain one (`speculate="auto"` and the cost
        model says so, where a static verification step would run — `_speculate`'s own test)."""
        if self.speculate != "auto" or self.vio is None:
            return False
        # `_verify_caps(seqs)[1] >= k` (every row's block of k + 1 fits), without the per-row caps: this runs
        # before every overlapped plain step, whose host time a plain engine does not spend
        limit = self.max_seq_len - 1 - self.drafter.k
        if any(s.num_cached_tokens > limit for s in seqs):
            return False
        self._ring_wanted = False
        if not self._worth_drafting(seqs):
            return True
        if self._ring_ready(seqs):
            return False
        self._ring_wanted = True  # no lean step until every row's ring holds what the drafter would read
        return True

    # ------------------------------------------------------------------ lean plain steps
    def _lean_possible(self) -> bool:
        return self.lean_plain and self.feature_ring is not None and bool(self.io.capture_layers) and (
            self.speculate == "auto")

    def _lean(self, seqs: list[Sequence]) -> bool:
        """Whether this plain step may leave the feature ring alone: the cost model at the batch's bucket drafts
        again no sooner than a window of plain steps from now (`CostModel.plain_ahead`; with no request waiting,
        with the rows' tokens left, as `_worth_drafting` asks it), so the drafter will need
        none of these positions' features — its catch-up reads at most the last window. The plain step of a
        drafter engine otherwise stores its features (means over streams, stack, scatter: ~7 kernels), on the H100
        on 2026-12-07 (64 rows, bf16) 1.91 ms a step against the plain engine's 1.82. A decision to draft that
        comes sooner (the batch drains, its bucket changes) waits until every row's ring holds a window again
        (`_ring_ready`)."""
        if self._ring_wanted or not self._lean_possible():
            return False
        here, W = bucket(len(seqs), self.buckets), self.config.window_size
        if self.cost_model.plain_ahead(here) > W:
            return True
        if self.scheduler.waiting:
            return False
        # within a window of the next probe (or past it): whether the batch, draining, will probe at all — the rows'
        # tokens left counted only here, not before every plain step
        return self.cost_model.plain_ahead(here, max(s.params.max_tokens - len(s.output) for s in seqs)) > W

    def _mark_lean(self, seqs: list[Sequence]) -> None:
        """After a lean step appended its position to each row: the ring holds the row's features from the next."""
        for seq in seqs:
            self._ring_from[seq.id] = seq.cache.n_tokens

    def _ring_ready(self, seqs: list[Sequence]) -> bool:
        """Whether the drafter can catch every row up from the feature ring: none lacks the features of a position
        it would read (`_catch_up`: from what it has seen, or the last window when it is further behind)."""
        if not self._ring_from:
            return True
        W = self.config.window_size
        for seq in seqs:
            start = self._ring_from.get(seq.id)
            if start is not None and start > max(self._drafter_seen.get(seq.id, 0), seq.cache.n_tokens - W):
                return False
        return True

    def _launch(self, seqs: list[Sequence], tokens: Tensor | None = None) -> _InFlight | None:
        """Launch the decode step of `seqs` — their pending tokens, or `tokens` (B,) on the device (the in-flight
        step's samples) — sample it on the device and start the tokens' copy to the host; None when sampling
        fails (the caller emits the step synchronously, which finds the failing row)."""
        B = len(seqs)
        host_tokens = [s.next_token for s in seqs] if tokens is None else [0] * B
        lean = self.drafter is not None and self._lean(seqs)
        logits = self._run_static(self.io, self.graphs, [s.cache for s in seqs], host_tokens, tokens_device=tokens,
                                  lean=lean)
        for seq, token in zip(seqs, host_tokens):
            seq.cache.tokens.append(token if tokens is None else _PENDING)  # the real id once it is read
        if lean:
            self._mark_lean(seqs)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += B
        if self.drafter is not None:  # a plain step the cost model chose (the drafter catches up later)
            self._count_plain(B)
        t0 = time.perf_counter()
        try:
            sampled = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        except Exception:  # noqa: BLE001 - `_emit` sorts out the failing row(s)
            self._phase("sample", t0)
            return None
        asked = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        on_device = self._launch_logprobs(seqs, logits, sampled, asked) if asked else ()
        host = self._inflight_host[self._launches % 2][:B] if self.device.type == "cuda" else None
        self._launches += 1
        if host is None:
            wait, lp_host = sampled.tolist, on_device
        else:
            host.copy_(sampled, non_blocking=True)
            lp_host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                            for t in on_device)
            done = torch.cuda.Event()
            done.record()

            def wait() -> list[int]:
                done.synchronize()
                return host.tolist()

        def logprobs() -> dict[int, tuple[float, list[tuple[int, float]]]]:
            if not asked:
                return {}
            chosen, top_ids, top_lp = (t.tolist() for t in lp_host)
            return {b: (chosen[j], list(zip(top_ids[j][:seqs[b].params.logprobs], top_lp[j][:seqs[b].params.logprobs])))
                    for j, b in enumerate(asked)}
        self._phase("sample", t0)
        return _InFlight(list(seqs), logits, sampled, wait, logprobs=logprobs)

    def _launch_logprobs(self, seqs: list[Sequence], logits: Tensor, sampled: Tensor, asked: list[int]
                         ) -> tuple[Tensor, Tensor, Tensor]:
        """(logprob, top ids, top logprobs) on the device of the step rows `asked` (`sampling.token_logprobs`
        of the unmodified logits, as `_logprobs`), queued before the next step can overwrite the logits."""
        index = to_device(asked, self.device)
        k = max(seqs[b].params.logprobs for b in asked)
        return token_logprobs(logits.index_select(0, index), sampled.index_select(0, index), k)

    def _overlapped_step(self) -> list[StepOutput]:
        """Launch the next decode step of the in-flight rows from their tokens on the device, then read and emit
        the in-flight step's tokens while the device runs it (the host's bookkeeping leaves the device's path)."""
        t0 = time.perf_counter()
        inflight = self._inflight
        self.stats.steps += 1
        self.stats.overlapped_steps += 1
        seqs = inflight.seqs
        tokens = inflight.tokens
        if inflight.rows != list(range(tokens.size(0))):  # rows ended at the last emission: their tokens out
            tokens = tokens.index_select(0, to_device(inflight.rows, self.device))
        nxt = self._launch(seqs, tokens=tokens)
        outputs = self._resolve(inflight, launched_next=True)
        if nxt is None:  # sampling the new step failed: emit it now for the rows that go on
            rows = [b for b, s in enumerate(seqs) if not s.finished]
            outputs.extend(self._emit([seqs[b] for b in rows], self.io.logits[:len(seqs)][rows]))
            self._inflight = None
        else:
            nxt.seqs = [s for s in seqs if not s.finished]
            nxt.rows = [b for b, s in enumerate(seqs) if not s.finished]
            self._inflight = nxt if nxt.seqs else None
        elapsed = time.perf_counter() - t0
        if self.drafter is not None:  # an overlapped step's wall time is what a plain step costs the stream
            self._measure("plain", len(seqs), elapsed, len(seqs))
        self._add_decode_time(seqs, elapsed)
        return outputs

    def _resolve(self, inflight: _InFlight, *, launched_next: bool) -> list[StepOutput]:
        """Read the in-flight step's tokens and emit them. With `launched_next`, each row's next step has run
        with its token already: the host's view is put back to the plain engine's (the token not yet in the
        cache) for the emission, and a row that ends here has that junk position dropped (its entry
        reservation, and its window-ring slot marked empty: the slot held position − W, which no later query
        needs) before `_finish` persists it. Rows finished meanwhile (aborted) are skipped."""
        t0 = time.perf_counter()
        sampled = inflight.wait()
        self._phase("sample", t0)
        rows = [i for i, s in enumerate(inflight.seqs) if not s.finished]
        seqs = [inflight.seqs[i] for i in rows]
        tokens = [sampled[inflight.rows[i]] for i in rows]
        if launched_next:
            for seq, token in zip(seqs, tokens):
                seq.cache.tokens.pop()  # the pending id of `token`, fed to the step now in flight
                if self._finishes(seq, token):
                    self._drop_junk(seq)
        # the tokens and log-probabilities are given: `_emit` reads no logits (these may hold the next step's
        # already, and their rows are the step's, not `seqs`')
        computed = inflight.logprobs()
        logprobs = [computed.get(inflight.rows[i], (None, None)) for i in rows]
        outputs = self._emit(seqs, inflight.logits, tokens, logprobs=logprobs)
        if launched_next:
            for seq, token in zip(seqs, tokens):
                if not seq.finished:
                    seq.cache.tokens.append(token)
        return outputs

    def _finishes(self, seq: Sequence, token: int) -> bool:
        """Whether `_emit` ends seq on this token (stop id, max_tokens, context)."""
        return (token in seq.params.stop_token_ids or len(seq.output) + 1 >= seq.params.max_tokens
                or seq.num_cached_tokens + 1 >= self.max_seq_len)

    def _drop_junk(self, seq: Sequence) -> None:
        """seq ends before the position its in-flight step wrote (position p = its token count): forget the
        entry that step may have reserved and mark the window-ring slot it overwrote empty in every layer."""
        cache = seq.cache
        p = cache.n_tokens
        self.io.wait_sent()  # truncate may rewrite the host page table the step in flight was sent from
        cache.truncate(p)
        self.pools.ring_positions[:, cache.slot, p % self.config.window_size] = -1

    def _phase(self, name: str, t0: float) -> float:
        """Add the wall time since t0 to phase `name` of `EngineStats.host_s`; returns the time now."""
        now = time.perf_counter()
        self.stats.host_s[name] = self.stats.host_s.get(name, 0.0) + now - t0
        return now

    def phase_ms(self, steps: int | None = None) -> dict[str, float]:
        """Milliseconds per step of each phase (`EngineStats.host_s`), over `steps` (default: every step)."""
        n = max(steps if steps is not None else self.stats.steps, 1)
        return {name: seconds * 1e3 / n for name, seconds in self.stats.host_s.items()}

    @staticmethod
    def _add_decode_time(seqs: list[Sequence], seconds: float) -> None:
        for seq in seqs:
            seq.decode_s += seconds / len(seqs)

    def _launch_sample(self, seqs: list[Sequence], logits: Tensor) -> Callable[[], list[int | None]]:
        """Sample the batch's tokens on the device and start their copy to a pinned host buffer, without
        waiting: returns the function that waits for that copy alone (an event) and gives the token ids.
        Work queued after it on the stream (the prefill pieces) is not waited for. A row whose sampling
        fails is found as `_emit` finds it, synchronously."""
        try:
            tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        except Exception:  # noqa: BLE001 - `_emit` sorts out the failing row(s)
            return lambda: None
        if self.device.type != "cuda":
            return tokens.tolist
        host = self._sampled_host[:len(seqs)]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> list[int | None]:
            done.synchronize()
            return host.tolist()
        return wait

    def _run_pieces(self, pieces: list, outputs: list[StepOutput]) -> None:
        """The scheduled prefill pieces, each through its job — those of sequences whose pieces this step have
        the same keys as one batched forward per piece (`PrefillJob.step_batch`), at the place of the first
        sequence; their outputs (a finished prompt's first token, a failure) into `outputs`."""
        if self.drafter is not None:
            for seq, _ in pieces:
                if seq.job is not None and not seq.job.capture_layers:
                    seq.job.capture_layers = tuple(self.drafter.features_wanted())
                    seq.job.capture_at = getattr(self.drafter, "features_at", "output")
        own: dict[int, list] = {}  # seq id → its pieces this step (scheduled one after the other)
        seqs_in_order: list[Sequence] = []
        for seq, piece in pieces:
            if seq.id not in own:
                own[seq.id] = []
                seqs_in_order.append(seq)
            own[seq.id].append(piece)
        groups: list[list[Sequence]] = []
        by_keys: dict[tuple, list[Sequence]] = {}
        for seq in seqs_in_order:
            if self.batch_prefill and seq.job is not None and seq.job.batchable:
                keys = tuple(p.key for p in own[seq.id])
                if keys not in by_keys:
                    by_keys[keys] = []
                    groups.append(by_keys[keys])
                by_keys[keys].append(seq)
            else:
                groups.append([seq])
        for group in groups:
            for piece in own[group[0].id]:
                live = [seq for seq in group if seq.job is not None]  # not failed nor finished earlier
                if len(live) > 1 and not all(seq.job.batchable for seq in live):
                    for seq in live:
                        self._run_group([seq], piece, outputs)
                elif live:
                    self._run_group(live, piece, outputs)

    def _run_group(self, seqs: list[Sequence], piece, outputs: list[StepOutput]) -> None:
        """One prefill piece of every sequence in `seqs` (one key) as one forward."""
        t0 = time.perf_counter()
        jobs = [seq.job for seq in seqs]
        static_runs = sum(job.static_runs for job in jobs)
        try:
            if len(seqs) == 1:
                results = [seqs[0].job.step(piece.tokens, piece.layers)]
            else:
                results = PrefillJob.step_batch([seq.job for seq in seqs], piece.tokens, piece.layers)
        except Exception as err:  # noqa: BLE001 - one request's failure must not stop the others' decode
            log.exception("prefill of request(s) %s failed", [seq.id for seq in seqs])
            outputs.extend(self._fail(seq, f"prefill failed: {err}") for seq in seqs)
            return
        self.stats.static_prefill_runs += sum(job.static_runs for job in jobs) - static_runs
        self.stats.prefill_forwards += 1
        ms = (time.perf_counter() - t0) * 1e3 / len(seqs)
        finished, rows = [], []
        for seq, logits in zip(seqs, results):
            seq.prefill_ms += ms
            self.stats.prefill_pieces += 1
            self.stats.prefill_tokens += piece.tokens if piece.new else 0
            self.stats.prefill_layer_passes += piece.layers
            if logits is not None:
                self._prefilled(seq)
                finished.append(seq)
                rows.append(logits)
        if finished:
            outputs.extend(self._emit(finished, torch.stack(rows)))

    def _prefilled(self, seq: Sequence) -> None:
        """A prompt's prefill has finished: store its prefix, start its drafter."""
        features, seq.job = seq.job.features, None
        if self.prefix_cache is not None and not seq.exact_prefill:
            self.prefix_cache.save(seq.cache, ends=[len(seq.prompt)], namespace=seq.namespace)
        if self.drafter is not None:
            self.drafter.start(seq.id)
            self._drafting.add(seq.id)
            self.drafter.observe(seq.id, torch.tensor(seq.cache.tokens, device=self.device), features)
            self._drafter_seen[seq.id] = seq.cache.n_tokens

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (client gone): nothing is persisted, its cache is freed."""
        seq.finish_reason = seq.finish_reason or "cancelled"
        if self._chained is not None and seq in self._chained.seqs:
            self._cancel_chain()  # before its slot is cleared: the undo writes the slot's window rings
        self._retire(seq)

    def metrics(self) -> dict:
        return self.prefix_cache.metrics() if self.prefix_cache is not None else {}

    # ------------------------------------------------------------------ capacity (the scheduler's view)
    def free_pages(self) -> dict[int, int]:
        return {s: self.pools.free_pages(s) for s in self.pools.sources}

    def pages_to_grow(self, seq: Sequence, n_tokens: int) -> dict[int, int]:
        target = min(seq.num_cached_tokens + n_tokens, self.max_seq_len)
        if target < seq.cache.page_limit():  # the pages held cover it (almost every decode step)
            return {}
        return self.pools.pages_needed(target, seq.cache.pages_held())

    def pages_to_admit(self, seq: Sequence) -> dict[int, int] | None:
        if self.pools.free_slots == 0:
            return None
        target = (seq.cache.n_tokens if seq.swapped is not None else len(seq.prompt)) + 1
        return self.pools.pages_needed(target)

    def admit(self, seq: Sequence) -> None:
        """Give a sequence its slot: swap a preempted one back in, or start a new one's prefill
        (resuming from the prefix cache when its prompt extends a stored prefix)."""
        if seq.swapped is not None:
            seq.cache.swap_in(seq.swapped)
            seq.swapped = None
            return
        seq.cache = cache = SequenceCache(self.config, pools=self.pools)
        use_cache = self.prefix_cache is not None and not seq.exact_prefill
        resume = self.prefix_cache.resume(cache, seq.prompt, namespace=seq.namespace) if use_cache else None
        if resume is None:
            seq.job = PrefillJob(self.runner, cache, seq.prompt, chunk=self.prefill_chunk, exact=seq.exact_prefill,
                                 images=seq.images, static=self.static)
        else:
            seq.cached_tokens, seq.replayed_tokens = resume.cached_tokens, resume.encoder_replay
            seq.job = PrefillJob(self.runner, cache, seq.prompt[resume.cached_tokens:], chunk=self.prefill_chunk,
                                 encoder_replay=resume.encoder_replay, decoder_windows_valid=resume.exact,
                                 images=seq.images, static=self.static)

    def preempt(self, seq: Sequence) -> None:
        if self._ring_ready([seq]):
            self._catch_up([seq])  # the feature ring is per slot: the drafter takes what it holds before the slot goes
        elif self.feature_ring is not None:  # what it lacks is lost with the slot: the ring fills again from here
            self._ring_from[seq.id] = seq.cache.n_tokens
        seq.swapped = seq.cache.swap_out()

    # ------------------------------------------------------------------ decode
    def _run_static(self, io: DecodeIO, graphs: DecodeGraphs | None, caches: list[SequenceCache],
                    tokens: list[int] | list[list[int]], drafts: Tensor | None = None,
                    tokens_device: Tensor | None = None, lean: bool = False) -> Tensor:
        """The static step of `io` (one token or a block of io.T per row) for these caches: logits
        io.logits[:B]. Replayed from `graphs` when given, eager otherwise. drafts (B, T − 1), a device
        tensor: block positions 1 … T − 1 come from it instead of `tokens` (device → device). lean: the
        step writes no features (`_lean`)."""
        B = len(caches)
        t0 = time.perf_counter()
        io.wait_sent()
        io.fill_batch(caches, tokens)
        n_entries = io.max_entries(B)
        Bb, n_max = graphs.shape(B, n_entries) if graphs is not None else (B, n_entries)
        io.pad(B, Bb)
        io.send()
        if drafts is not None:
            io.device[io.TOK + 1:io.TOK + io.T, :B].copy_(drafts.t())
        if tokens_device is not None:  # device → device: the tokens never visit the host before the step
            io.device[io.TOK, :B].copy_(tokens_device)
        t0 = self._phase("prepare", t0)
        try:
            return self._launch_static(io, graphs, B, Bb, n_max, n_entries, lean)
        finally:
            self._phase("launch", t0)

    def _launch_static(self, io: DecodeIO, graphs: DecodeGraphs | None, B: int, Bb: int, n_max: dict[int, int],
                       n_entries: dict[int, int], lean: bool = False) -> Tensor:
        if graphs is not None:
            try:
                return graphs.run(B, n_max, lean=lean)
            except RuntimeError as err:  # a kernel that cannot be captured: run eagerly from now on
                log.warning("CUDA-graph capture failed (%s); running the static steps eagerly", err)
                self.graphs = self.vgraphs = None
                torch.cuda.synchronize()
                return self.runner.decode(io, Bb, n_max, features=not lean)[:B]
        return self.runner.decode(io, B, n_entries, features=not lean)

    def _decode(self, seqs: list[Sequence]) -> Tensor:
        """Run each sequence's pending token through all layers at once: logits (B, vocab)."""
        lean = self.drafter is not None and self._lean(seqs)
        logits = self._run_static(self.io, self.graphs, [seq.cache for seq in seqs], [seq.next_token for seq in seqs],
                                  lean=lean)
        for seq in seqs:
            seq.cache.tokens.append(seq.next_token)
        if lean:
            self._mark_lean(seqs)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(seqs)
        return logits

    # ------------------------------------------------------------------ speculative decode
    def _timed_static_step(self, caches: list[SequenceCache], block: list[list[int]]) -> dict:
        """One static step over throw-away caches for the start-up profile (`profile_step_time`): T = 1 is
        the plain decode step, T = k + 1 the verification step. Returns its projections (the rollback)."""
        T = len(block[0])
        if T == 1:
            self._run_static(self.io, self.graphs, caches, [row[0] for row in block]).argmax(-1).tolist()
            projections = {}
        else:
            self._run_static(self.vio, self.vgraphs, caches, block).argmax(-1).tolist()  # the sync a step makes
            projections = {s: (kv[:len(caches)], sc[:len(caches)]) for s, (kv, sc) in self.vio.projections.items()}
        for cache, row in zip(caches, block):
            cache.tokens.extend(row)
        return projections

    def _verify_caps(self, seqs: list[Sequence]) -> tuple[list[int], int]:
        """Per row the longest useful verification (drafts ≤ k, emitted tokens ≤ max_tokens left) and the
        batch's bound (every row's padded block must fit max_seq_len)."""
        k = self.drafter.k
        room = [self.max_seq_len - s.num_cached_tokens - 1 for s in seqs]  # positions left after the pending one
        caps = [max(0, min(k, s.params.max_tokens - len(s.output) - 1, r)) for s, r in zip(seqs, room)]
        return caps, max(0, min(room))

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Hand the drafter the tokens it has not seen (decoded plainly, `speculate="auto"`) with their
        features from the feature ring — at most the last window of them, all a drafter attends to. Rows
        that lag by at most a window go in one batched `observe_many` when the drafter has it."""
        if self.feature_ring is None:
            return
        W = self.config.window_size
        lagging = []  # (sequence, tokens seen, tokens cached)
        for seq in seqs:
            seen = self._drafter_seen.get(seq.id)
            if seen is not None and seq.cache is not None and not seq.cache.released and seen < seq.cache.n_tokens:
                start = self._ring_from.get(seq.id)
                if start is not None and start > max(seen, seq.cache.n_tokens - W):
                    continue  # a lean step's positions among those it would read (`_ring_ready`): none to hand over
                lagging.append((seq, seen, seq.cache.n_tokens))
        if not lagging:
            return
        layers = self.io.capture_layers
        many = getattr(self.drafter, "observe_many", None)
        # a drafter that can skip (`observe_many_skips`) takes rows a window or more behind in the same call: only
        # their last W positions (one by one, 64 rows after 176 plain steps made a 36 ms probe step, H100, 2026-12-07)
        skips = many is not None and getattr(self.drafter, "observe_many_skips", False)
        batched = [row for row in lagging if skips or row[2] - row[1] <= W] if many is not None else []
        if batched:
            starts = [max(seen, n - W) for _, seen, n in batched]  # the block: the last ≤ W positions
            T = max(n - start for (_, _, n), start in zip(batched, starts))
            first = torch.tensor(starts, device=self.device)
            last = torch.tensor([n - 1 for _, _, n in batched], device=self.device)
            positions = torch.minimum(first.unsqueeze(1) + torch.arange(T, device=self.device),
                                      last.unsqueeze(1))  # (B, T); padding repeats a row's last position
            slots = torch.tensor([seq.cache.slot for seq, _, _ in batched], device=self.device)
            rows = self.feature_ring[slots.unsqueeze(1), positions % W]  # (B, T, n_layers, dim)
            tokens = torch.tensor([(seq.cache.tokens[start:n] + [0] * T)[:T]
                                   for (seq, _, n), start in zip(batched, starts)], device=self.device)  # (B, T)
            skipped = [start - seen for (_, seen, _), start in zip(batched, starts)]
            many([seq.id for seq, _, _ in batched], tokens, {layer: rows[:, :, j] for j, layer in enumerate(layers)},
                 [n - start for (_, _, n), start in zip(batched, starts)], *([skipped] if any(skipped) else []))
        done = {seq.id for seq, _, _ in batched}
        for seq, seen, n in lagging:
            if seq.id not in done:
                m = min(n - seen, W)
                positions = torch.arange(n - m, n, device=self.device)
                rows = self.feature_ring[seq.cache.slot, positions % W]  # (m, n_layers, dim)
                self.drafter.observe(seq.id, torch.tensor(seq.cache.tokens[seen:n], device=self.device),
                                     {layer: rows[:, j] for j, layer in enumerate(layers)})
            self._drafter_seen[seq.id] = n
            self._ring_from.pop(seq.id, None)  # every position before n seen: its lean ones are behind it

    def _worth_drafting(self, seqs: list[Sequence]) -> bool:
        """`speculate="auto"`: whether this batch drafts (the engine's `CostModel`, per batch bucket, with
        the rows' own tokens per verification). With no request waiting the batch drains: the rows' remaining
        tokens (to `max_tokens`) go with them, and the row that would finish last decides."""
        rows = [s.spec_tokens for s in seqs]
        here = bucket(len(seqs), self.buckets)
        if self.project_batch:
            # prompts prefill or wait for a free slot: each step carries one prefill piece, so a verification step
            # (2-4x a plain one's time) delays every waiting prompt; the batch they make decides when measured
            joining = len(self.scheduler.running) + len(self.scheduler.waiting)
            soon = bucket(min(self.max_batch, max(len(seqs), joining)), self.buckets)
            if soon > here and self.cost_model.drafts_at(soon, rows) is False:
                return False
        remaining = None
        if not self.scheduler.waiting:  # (a running row has a token left to generate: ≥ 1)
            remaining = [s.params.max_tokens - len(s.output) for s in seqs]
        return self.cost_model.worth_drafting(here, rows, remaining)

    def reset_cost_model(self) -> None:
        """Forget the cost model's measurements (after steps timed under a profiler, say: its overhead
        would make every speculative step look slow)."""
        self.cost_model.reset()

    def _measure(self, kind: str, B: int, seconds: float, tokens: int) -> None:
        """One step's wall time and tokens into the cost model — `mixed` while the device may still run the prefill
        pieces of the step before (`_pieces_behind`: the next two decode steps after a step with pieces)."""
        mixed = self._pieces_behind > 0
        self._pieces_behind = max(0, self._pieces_behind - 1)
        self.cost_model.record(kind, bucket(B, self.buckets), B, seconds, tokens, mixed=mixed)

    def _propose(self, seqs: list[Sequence], *, wait: bool = True, anchors: list[int] | None = None,
                 anchors_device: Tensor | None = None):
        """The drafter's proposal for the batch, its shapes checked (None when it fails), and with `wait` its
        token ids checked and its confidences on the host; without (the static step), both come after the
        forward (`_fetch_proposal`), so nothing waits for the drafter here. anchors: each row's pending token
        (default: its `next_token`); anchors_device: the same on the device (the device's acceptance made them)."""
        k, B = self.drafter.k, len(seqs)
        try:
            if anchors_device is None:
                self._anchors.numpy()[:B] = [s.next_token for s in seqs] if anchors is None else anchors
                anchors_device = self._anchors_device(B)
            prop = self.drafter.propose([s.id for s in seqs], anchors_device)
            if tuple(prop.tokens.shape) != (B, k) or tuple(prop.confidence.shape) != (B, k):
                raise ValueError(f"proposal shapes {tuple(prop.tokens.shape)}, {tuple(prop.confidence.shape)}; "
                                 f"({B}, {k}) expected")
            if prop.probs is not None and tuple(prop.probs.shape) != (B, k, self.config.vocab_size):
                raise ValueError(f"proposal probs of shape {tuple(prop.probs.shape)}")
            if not wait:
                return prop, None
            if bool(self._invalid_rows(prop).any()):
                raise ValueError("proposal holds token ids outside the vocabulary")
            confidence = prop.confidence.float().clamp(0, 1).tolist()
        except Exception:  # noqa: BLE001 - a broken drafter costs speed, never correctness
            log.exception("the drafter failed; this step verifies no drafts")
            return None, None
        return prop, confidence

    def _proposes_next(self, seqs: list[Sequence], ask_cost_model: bool = True) -> bool:
        """Whether the next step's proposal may be launched before this one's bookkeeping: the drafter's
        proposals are a function of its state and the anchors (`pure_propose`: one launched and not used changes
        nothing), no request waits (the next step would schedule it) and (ask_cost_model) the cost model drafts at
        this batch — asked once the caches hold what the step keeps (`_chain`), as the next step would ask."""
        return (getattr(self.drafter, "pure_propose", False) and not self.scheduler.waiting
                and (not ask_cost_model or self.speculate == "always" or self._worth_drafting(seqs)))

    def _chain(self, seqs: list[Sequence], plans: list[tuple[list[int], str | None]],
               early: Proposal | None = None) -> None:
        """After a verification's hand-over, before its bookkeeping (emission, statistics) and the next step's
        scheduling: launch the next step's proposal — and its verification too where that step is certain to
        be these rows verifying again — so the device drafts and verifies while the host does the rest.

        The proposal (`_next_proposal`) when every row goes on, no request waits, the cost model drafts at this
        batch size, and the drafter's proposals are a function of its state and the anchors (`pure_propose`:
        one launched and not used changes nothing); the next `_speculate` takes it if nothing it was made from
        has changed (`_prelaunched`). The verification too (`_chained`) when, besides, these rows are all the
        engine runs (no prefill under way), none asks for log-probabilities (the step's logits buffer is the
        next one's), and each row's next block fits the context and the pages it holds; the next
        `step` resolves it without scheduling (`_chained_step`) or, if its rows changed meanwhile (an abort),
        undoes it (`_cancel_chain`). early: the proposal the device's acceptance launched already
        (`_follow_on_device`); when rows finish, the others keep their rows of it."""
        self._next_proposal = None
        going = [b for b, (_, reason) in enumerate(plans) if reason is None]
        if early is not None and len(going) < len(seqs):
            if going:
                self._next_proposal = _Prelaunched([seqs[b].id for b in going],
                                                   [seqs[b].cache.n_tokens for b in going], early, going)
            return
        if len(going) < len(seqs) or not self._proposes_next(seqs):
            return
        anchors = [tokens[-1] for tokens, _ in plans]  # each row's next pending token
        prop = early if early is not None else self._propose(seqs, wait=False, anchors=anchors)[0]
        if prop is None:
            return
        k = self.drafter.k
        running = self.scheduler.running
        if (self.vio is not None and len(running) == len(seqs) and all(a is b for a, b in zip(running, seqs))
                and all(s.params.logprobs is None and self.max_seq_len - s.cache.n_tokens - 1 >= k
                        and not self.pages_to_grow(s, k + 1) for s in seqs)):
            on_device = prop.tokens.long().clamp(0, self.config.vocab_size - 1)
            caches = [s.cache for s in seqs]
            starts = [cache.n_tokens for cache in caches]
            logits = self._run_static(self.vio, self.vgraphs, caches, [[a] * (k + 1) for a in anchors],
                                      drafts=on_device)
            self._chained = _Chained(list(seqs), starts, prop, on_device, logits)
            return
        self._next_proposal = _Prelaunched([s.id for s in seqs], [s.cache.n_tokens for s in seqs], prop)

    def _chain_holds(self, chained: _Chained) -> bool:
        """Whether the launched verification's rows are still the engine's decode batch (nothing scheduled
        since: a request that arrived meanwhile waits one step, no new verification is chained while it does);
        rows taken out of the schedule meanwhile (a caller pausing them) undo it instead."""
        running = {id(s) for s in self.scheduler.running}
        return all(id(s) in running and s.status is SequenceStatus.RUNNING and s.job is None and not s.finished
                   and s.cache is not None and not s.cache.released for s in chained.seqs)

    def _chained_step(self) -> list[StepOutput]:
        """The step whose verification `_chain` launched: resolve it (and chain the next one)."""
        chained, self._chained = self._chained, None
        self.stats.steps += 1
        self.stats.speculative.chained += 1
        t0 = time.perf_counter()
        outputs = self._speculate(chained.seqs, chained)
        self._add_decode_time(chained.seqs, time.perf_counter() - t0)
        return outputs

    def _cancel_chain(self) -> None:
        """Undo the launched verification before its rows change: every row keeps none of its block (the
        rollback restores its window rings and partial groups; the entry rows it reserved are dropped)."""
        chained, self._chained = self._chained, None
        self.stats.speculative.chain_cancelled += 1
        self._restore_static([s.cache for s in chained.seqs], chained.starts, [0] * len(chained.seqs))

    def _prelaunched(self, seqs: list[Sequence]) -> Proposal | None:
        """The proposal `_chain` made for exactly this step (same rows in the same order, their caches unchanged
        since), or None; either way it is used up."""
        early, self._next_proposal = self._next_proposal, None
        if early is None or early.ids != [s.id for s in seqs] or early.n_tokens != [s.cache.n_tokens for s in seqs]:
            return None
        self.stats.speculative.prelaunched += 1
        prop = early.proposal
        if early.rows is not None:  # rows finished since it was launched: the others' rows (each row drafts alone)
            rows = torch.tensor(early.rows, device=prop.tokens.device)
            prop = Proposal(tokens=prop.tokens.index_select(0, rows), confidence=prop.confidence.index_select(0, rows))
        return prop

    def _anchors_device(self, B: int) -> Tensor:
        """Each row's pending token on the device: one copy from the pinned host mirror."""
        out = self._anchors_dev[:B]
        out.copy_(self._anchors[:B], non_blocking=True)
        return out

    def _fetch_proposal(self, prop, drafts: Tensor, logits: Tensor
                        ) -> tuple[list[list[int]], list[bool], list[list[int]]]:
        """After the verification step: the drafts (B, k) the step ran (the proposal's ids clamped into the
        vocabulary — a row that needed it verifies nothing), per row whether its ids were valid, and the argmax
        of each verified position (logits (B, T, V): what greedy acceptance compares) — one transfer."""
        bad = self._invalid_rows(prop)
        rows = torch.cat((drafts, bad.long().unsqueeze(1), logits.argmax(dim=-1)), dim=1).tolist()  # waits
        return self._split_fetched(rows, drafts.size(1))

    def _invalid_rows(self, prop: Proposal) -> Tensor:
        """(B,) bool on the device: the rows whose proposal holds a token id outside the vocabulary."""
        ids = prop.tokens.long()
        return ((ids < 0) | (ids >= self.config.vocab_size)).any(dim=1)

    @staticmethod
    def _split_fetched(rows: list[list[int]], k: int) -> tuple[list[list[int]], list[bool], list[list[int]]]:
        """Rows read back as [drafts (k), invalid flag, argmax of each verified position] → (drafts, valid,
        argmax), with a warning when a row's proposal was invalid (`_fetch_proposal`, `_accept_on_device`)."""
        if any(row[k] for row in rows):
            log.warning("the drafter proposed token ids outside the vocabulary; those rows verify no drafts")
        return [row[:k] for row in rows], [not row[k] for row in rows], [row[k + 1:] for row in rows]

    def _speculate(self, seqs: list[Sequence], chained: _Chained | None = None) -> list[StepOutput]:
        """One verification step: propose, choose lengths, verify in one forward, accept, roll back, emit (the
        static step chooses lengths after its forward: the drafts never wait on the host before it).
        The forward is the static verification step of k + 1 positions (a CUDA graph on GPUs) whenever
        every row's block fits max_seq_len; otherwise the host-driven forward over max L + 1 positions.
        chained: this step's static verification, launched already at the end of the step before (`_chain`).
        The caller has asked the cost model (`_decides_plain`: a static step it turns plain never comes here)."""
        c, B, stats, k = self.config, len(seqs), self.stats.speculative, self.drafter.k
        accepted = early = None  # the device's greedy acceptance and the next proposal it launched (static step)
        caps, batch_cap = self._verify_caps(seqs)
        static = chained is not None or (self.vio is not None and batch_cap >= k)
        if chained is None:
            self._catch_up(seqs)  # a cost of the plain steps before, not of this one
        t0 = time.perf_counter()
        caches = [s.cache for s in seqs]
        starts = [cache.n_tokens for cache in caches]
        rollback = None
        if static:  # the static step computes k + 1 positions whatever the lengths are
            T = k + 1
            if chained is not None:
                prop, on_device, logits = chained.proposal, chained.drafts, chained.logits
            else:
                prop = self._prelaunched(seqs)
                if prop is None:
                    prop, _ = self._propose(seqs, wait=False)
                if prop is None:
                    return self._plain_step(seqs)
                # the drafts go from the proposal into the step's token rows on the device: no host round trip
                # before the forward; the host learns them after it, in the step's one wait. The k + 1
                # positions are computed by then, so every row verifies all it may (its cap; 0 where the
                # drafter proposed ids outside the vocabulary): shortening it now would save nothing. Whether to
                # draft at all is decided before the step (`speculate="auto"`, the cost model).
                on_device = prop.tokens.long().clamp(0, c.vocab_size - 1)  # (B, k)
                logits = self._run_static(self.vio, self.vgraphs, caches, [[s.next_token] * T for s in seqs],
                                          drafts=on_device)  # (B, T, V) fp32
            lengths = [min(cap, batch_cap) for cap in caps]  # 0 below where the proposal's ids were invalid
            if self._accepts_on_device(seqs, prop):
                # greedy acceptance, rollback, hand-over and the next proposal queued behind the forward before
                # the host waits: the device goes on while the host reads the result and does the bookkeeping
                accepted = self._accept_on_device(prop, on_device, logits, lengths)
                early = self._follow_on_device(seqs, accepted)
                drafts, valid, greedy_ids, device_keep = accepted.wait()
            else:
                drafts, valid, greedy_ids = self._fetch_proposal(prop, on_device, logits)
            lengths = [n if ok else 0 for n, ok in zip(lengths, valid)]
            block = [[s.next_token] + d for s, d in zip(seqs, drafts)]
            features = {layer: self.vio.features[j, :B] for j, layer in enumerate(self.vio.capture_layers)}
            projections = {s: (kv[:B], sc[:B]) for s, (kv, sc) in self.vio.projections.items()}
        else:
            greedy_ids = None
            prop, confidence = self._propose(seqs)
            if prop is None:
                lengths = [0] * B
                drafts = [[] for _ in seqs]
            else:
                lengths = choose_lengths(confidence, [min(cap, batch_cap) for cap in caps], self.step_time,
                                         padded=True)
                drafts = prop.tokens.long().tolist()
            T = max(lengths) + 1
            # rows shorter than T are padded with their own later drafts (never accepted, rolled back)
            block = [[s.next_token] + (d + [s.next_token] * T)[:T - 1] for s, d in zip(seqs, drafts)]
            rollback = VerifyRollback(self.pools, caches, starts, T)
            capture = Capture(layers=tuple(self.drafter.features_wanted()),
                              at=getattr(self.drafter, "features_at", "output"), projections=True)
            h, pre_mix = self.runner.forward(caches, torch.tensor(block, device=self.device), starts,
                                             range(c.n_layers), capture=capture)
            logits = self.model.head_logits(hc_pre(h, pre_mix))  # (B, T, V) fp32
            features, projections = capture.features, capture.kv_projections
        for cache, row in zip(caches, block):
            cache.tokens.extend(row)
        verdicts = verify(logits, drafts, lengths, [s.params for s in seqs], [s.generator for s in seqs],
                          None if prop is None else prop.probs, greedy_ids=greedy_ids)
        plans = [self._emission(s, v.tokens, start) for s, v, start in zip(seqs, verdicts, starts)]
        kept = [len(tokens) for tokens, _ in plans]
        if accepted is not None:
            self._settle_on_device(seqs, starts, kept, device_keep)
        elif rollback is None:
            self._restore_static(caches, starts, kept)
        else:
            rollback.restore(kept, projections)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += sum(kept)
        stats.forwards += 1
        if accepted is None:  # the drafter sees the committed block positions of the rows that go on
            self._observe(seqs, block, features, [n if reason is None else 0 for n, (_, reason) in zip(kept, plans)])
        if static:
            self._chain(seqs, plans, early)  # before the bookkeeping below: the device works while the host does it
        outputs: list[StepOutput] = []
        for b, (seq, v, (tokens, reason)) in enumerate(zip(seqs, verdicts, plans)):
            stats.record(lengths[b], v.accepted, len(tokens))
            if reason is None:  # a finishing row's count is cut by its end, not by its drafts
                seq.spec_tokens = self.cost_model.row_average(seq.spec_tokens, len(tokens))
            logprobs = self._logprobs([seq] * len(tokens), logits[b, :len(tokens)], tokens)
            for j, (token, (lp, top)) in enumerate(zip(tokens, logprobs)):
                last = j == len(tokens) - 1
                if last and reason == "stop":
                    seq.finish_reason = "stop"
                    self._finish(seq)
                    outputs.append(StepOutput(seq, None, True, lp, top))
                    break
                seq.output.append(token)
                seq.next_token = token
                if last and reason is not None:
                    seq.finish_reason = reason
                    self._finish(seq)
                outputs.append(StepOutput(seq, token, seq.finished, lp, top))
        if static:  # the whole step, its emission included (as a plain step's measure includes `_emit`)
            self._measure("spec", B, time.perf_counter() - t0, sum(len(tokens) for tokens, _ in plans))
        return outputs

    def _accepts_on_device(self, seqs: list[Sequence], prop: Proposal) -> bool:
        """Whether this static verification's acceptance runs on the device (`_accept_on_device`): every row is
        greedy (exact match needs no random draw), the drafts are deterministic, and the drafter takes its hand-over
        counts from the device (`observe_many_device`)."""
        return (prop.probs is None and hasattr(self.drafter, "observe_many_device")
                and all(s.params.greedy for s in seqs))

    def _accept_on_device(self, prop: Proposal, drafts: Tensor, logits: Tensor, lengths: list[int]) -> _Accepted:
        """Greedy acceptance of the static verification on the device, queued behind its forward: row b accepts
        the longest prefix of its drafts (B, k) within lengths[b] (0 where the proposal's ids were invalid) equal
        to the argmax of logits (B, k + 1, V) — as `verify` does on the host — and keeps accepted + 1 positions; its
        next pending token is the argmax after the accepted prefix. The result goes to a pinned host buffer in one
        copy, followed by an event: `wait` waits for that copy only, not for work queued after it."""
        B, k = drafts.shape
        self._lengths.numpy()[:B] = lengths  # its last copy out ran before the last step's wait
        live = self._lengths_dev[:B]
        live.copy_(self._lengths[:B], non_blocking=True)
        bad = self._invalid_rows(prop)  # (B,)
        greedy = logits.argmax(dim=-1)  # (B, k + 1): ties to the lowest id, as the host's `verify`
        verified = self._draft_positions < torch.where(bad, 0, live).unsqueeze(1)  # (B, k)
        n = ((drafts == greedy[:, :k]) & verified).long().cumprod(dim=1).sum(dim=1)  # (B,) accepted drafts
        anchors = greedy.gather(1, n.unsqueeze(1)).squeeze(1)  # (B,)
        out = self._accepted_host[:B]
        out.copy_(torch.cat((drafts, bad.long().unsqueeze(1), greedy, (n + 1).unsqueeze(1)), dim=1), non_blocking=True)
        event = self._accepted_event
        if event is not None:
            event.record()

        def wait() -> tuple[list[list[int]], list[bool], list[list[int]], list[int]]:
            if event is not None:
                event.synchronize()
            rows = out.tolist()  # the keep count last
            return *self._split_fetched([r[:-1] for r in rows], k), [r[-1] for r in rows]

        return _Accepted(n + 1, anchors, wait)

    def _follow_on_device(self, seqs: list[Sequence], accepted: _Accepted) -> Proposal | None:
        """What follows the device's acceptance, queued before the host has read it: the rollback to each row's
        keep count, the drafter's hand-over of the kept positions (their count from the device) and, when the
        next step drafts these rows (`_proposes_next`), its proposal from the new pending tokens (returned).
        `_settle_on_device` brings the host's side along once it has the counts."""
        B, vio = len(seqs), self.vio
        vio.keep_device.fill_(vio.T)  # padding rows keep all T
        vio.keep_device[:B].copy_(accepted.keep)
        if self.vgraphs is not None:
            self.vgraphs.restore(B)
        else:
            self.runner.restore(vio, B)
        features = {layer: vio.features[j, :B] for j, layer in enumerate(vio.capture_layers)}
        self.drafter.observe_many_device([s.id for s in seqs], features, accepted.keep)
        if not self._proposes_next(seqs, ask_cost_model=False):  # `_chain` asks it, and drops this one on a no
            return None
        return self._propose(seqs, wait=False, anchors_device=accepted.anchors)[0]

    def _settle_on_device(self, seqs: list[Sequence], starts: list[int], kept: list[int], device_keep: list[int]
                          ) -> None:
        """The host's side of `_follow_on_device`: each cache truncated to the positions its row keeps (`kept`: the
        emission; a row cut short by its end differs from the device's count — then the rollback runs again, with
        these counts: it restores from the same snapshot), and the drafter's host counts moved by the device's."""
        caches = [s.cache for s in seqs]
        if kept != device_keep:
            self._restore_static(caches, starts, kept)
        else:
            for cache, start, n in zip(caches, starts, kept):
                cache.truncate(start + n)
        ids = [s.id for s in seqs]
        self.drafter.observed_more(ids, device_keep)
        for seq_id, n in zip(ids, device_keep):
            self._drafter_seen[seq_id] = self._drafter_seen.get(seq_id, 0) + n

    def _restore_static(self, caches: list[SequenceCache], starts: list[int], keep: list[int]) -> None:
        """Undo the static verification step past each row's keep count: the device half replayed from
        the rollback graph (or eagerly), then each cache truncated on the host."""
        B = len(caches)
        self.vio.send_keep(keep)
        if self.vgraphs is not None:
            self.vgraphs.restore(B)
        else:
            self.runner.restore(self.vio, B)
        for cache, start, n in zip(caches, starts, keep):
            cache.truncate(start + n)

    def _count_plain(self, rows: int) -> None:
        """A plain decode step of an engine with a drafter (its statistics)."""
        self.stats.speculative.plain_steps += 1
        self.stats.speculative.plain_tokens += rows

    def _plain_step(self, seqs: list[Sequence]) -> list[StepOutput]:
        self._count_plain(len(seqs))
        t0 = time.perf_counter()
        outputs = self._emit(seqs, self._decode(seqs))
        self._measure("plain", len(seqs), time.perf_counter() - t0, len(seqs))
        return outputs

    def _observe(self, seqs: list[Sequence], block: list[list[int]], features: dict[int, Tensor],
                 keep: list[int]) -> None:
        """Row b's first keep[b] block positions (tokens and features) to the drafter, in one batched call
        when it has `observe_many`."""
        if not any(keep):
            return
        many = getattr(self.drafter, "observe_many", None)
        if many is not None:
            many([s.id for s in seqs], torch.tensor(block, device=self.device), features, keep)
        else:
            for b, (seq, n) in enumerate(zip(seqs, keep)):
                if n:
                    self.drafter.observe(seq.id, torch.tensor(block[b][:n], device=self.device),
                                         {i: f[b, :n] for i, f in features.items()})
        for seq, n in zip(seqs, keep):
            if n:
                self._drafter_seen[seq.id] = self._drafter_seen.get(seq.id, 0) + n

    def _emission(self, seq: Sequence, tokens: list[int], start: int) -> tuple[list[int], str | None]:
        """The tokens a verification emits, cut where plain decoding would have finished, and the finish
        reason (None: it goes on). After the j-th token plain decoding would hold start + j tokens."""
        out_len = len(seq.output)
        for j, token in enumerate(tokens, start=1):
            if token in seq.params.stop_token_ids:
                return tokens[:j], "stop"
            if out_len + j >= seq.params.max_tokens or start + j + 1 >= self.max_seq_len:
                return tokens[:j], "length"
        return tokens, None

    # ------------------------------------------------------------------ sampling and finishing
    def _emit(self, seqs: list[Sequence], logits: Tensor, sampled: list[int | None] | None = None,
              logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None = None
              ) -> list[StepOutput]:
        """Sample one token per sequence from logits (B, vocab) — one call, each row with its own
        parameters and generator — and record it. A row whose sampling fails fails alone. sampled: the
        tokens `_launch_sample` drew already (None: sample here); logprobs: theirs, computed already
        (None: from logits here)."""
        tokens: list[int | None]
        t0 = time.perf_counter()
        try:
            if sampled is None:
                sampled = sample(logits, [s.params for s in seqs], [s.generator for s in seqs]).tolist()
                t0 = self._phase("sample", t0)
            tokens = sampled
        except Exception:  # noqa: BLE001 - find the row(s) at fault, keep the others
            tokens = []
            for i, seq in enumerate(seqs):
                try:
                    tokens.append(int(sample(logits[i:i + 1], [seq.params], [seq.generator])[0]))
                except Exception as err:  # noqa: BLE001
                    log.exception("sampling for request %d failed", seq.id)
                    tokens.append(None)
                    seq.error = f"sampling failed: {err}"
        if logprobs is None:
            logprobs = self._logprobs(seqs, logits, tokens)
        outputs = []
        for seq, token, (lp, top) in zip(seqs, tokens, logprobs):
            if token is None:
                outputs.append(self._fail(seq, seq.error))
                continue
            if token in seq.params.stop_token_ids:
                seq.finish_reason = "stop"
                self._finish(seq)
                outputs.append(StepOutput(seq, None, True, lp, top))
                continue
            seq.output.append(token)
            seq.next_token = token
            if len(seq.output) >= seq.params.max_tokens:
                seq.finish_reason = "length"
            elif seq.num_cached_tokens + 1 >= self.max_seq_len:
                seq.finish_reason = "length"  # the next token would not fit the context
            if seq.finish_reason is not None:
                self._finish(seq)
            outputs.append(StepOutput(seq, token, seq.finished, lp, top))
        self._phase("emit", t0)
        return outputs

    @staticmethod
    def _logprobs(seqs: list[Sequence], logits: Tensor, tokens: list[int | None]
                  ) -> list[tuple[float | None, list[tuple[int, float]] | None]]:
        """(logprob, top alternatives) per row for the rows whose params ask (log-softmax of the
        unmodified logits, `sampling.token_logprobs`), one batched call."""
        out: list[tuple[float | None, list[tuple[int, float]] | None]] = [(None, None)] * len(seqs)
        rows = [i for i, (s, t) in enumerate(zip(seqs, tokens)) if s.params.logprobs is not None and t is not None]
        if not rows:
            return out
        k = max(seqs[i].params.logprobs for i in rows)
        index = torch.tensor(rows, device=logits.device)
        chosen, top_ids, top_lp = token_logprobs(logits.index_select(0, index),
                                                 torch.tensor([tokens[i] for i in rows], device=logits.device), k)
        chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
        for j, i in enumerate(rows):
            n = seqs[i].params.logprobs
            out[i] = (chosen[j], list(zip(top_ids[j][:n], top_lp[j][:n])))
        return out

    def _fail(self, seq: Sequence, message: str | None) -> StepOutput:
        seq.error = message or "request failed"
        seq.finish_reason = "error"
        self.stats.failures += 1
        self._retire(seq)
        return StepOutput(seq, None, True, error=seq.error)

    def _finish(self, seq: Sequence) -> None:
        """Output end: persist the conversation's units and its window snapshot, free the cache."""
        if self.prefix_cache is not None and not seq.exact_prefill and seq.cache is not None \
                and not seq.cache.released and seq.job is None:
            self.prefix_cache.save(seq.cache, ends=[seq.cache.n_tokens], namespace=seq.namespace)
        self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        if seq.id in self._drafting:
            self._drafting.discard(seq.id)
            self._drafter_seen.pop(seq.id, None)
            self._ring_from.pop(seq.id, None)
            self.drafter.finish(seq.id)
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.job = None
        seq.swapped = None
        if seq.cache is not None and not seq.cache.released:
            seq.cache.release()

    # ------------------------------------------------------------------ simple API
    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                 exact_prefill: bool = False, images: list[list] | None = None, **sampling) -> list[list[int]]:
        """Generate for each prompt (with its images, when given); returns the new token ids (stop ids excluded)."""
        images = images or [None] * len(prompts)
        seqs = [self.add_request(p, SamplingParams(temperature=temperature, max_tokens=max_tokens, **sampling),
                                 exact_prefill, images=im) for p, im in zip(prompts, images)]
        while any(not s.finished for s in seqs):
            self.step()
        return [s.output for s in seqs]
