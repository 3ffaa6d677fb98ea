"""One request's whole state in the engine: status, token ids, its cache (slot + pages), progress.

nano-vllm's `Sequence` is the model (one object per request that every part reads): the engine,
its scheduler, the server and the prefix cache all look at the same `Sequence`. Host-side
bookkeeping only — the bytes live in the `BlockManager`'s pools, reached through `seq.cache`.

Life: WAITING (queued) → RUNNING (holds a slot and pages; first its `PrefillJob` advances a piece
per step, then it decodes one token per step) → FINISHED. Under memory pressure a running sequence
is PREEMPTED: its cache is swapped to host memory (bit-exact) and it waits at the head of the
queue until it can be swapped back in.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsv41.engine.sampling import SamplingParams

if TYPE_CHECKING:  # keep this module importable without torch-heavy imports
    from dsv41.engine.cache import SequenceCache
    from dsv41.engine.prefill import PrefillJob, PromptImages


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    exact_prefill: bool = False
    generator: Any = None  # the request's torch.Generator (sampling)
    namespace: str | bytes | None = None  # prefix-cache namespace (tenant, cache salt)
    images: PromptImages | None = None  # the prompt's image embeddings (vision stage output), used at prefill
    status: SequenceStatus = SequenceStatus.WAITING
    output: list[int] = field(default_factory=list)  # sampled tokens shown to the user
    next_token: int | None = None  # sampled, not yet run through the model
    finish_reason: str | None = None
    error: str | None = None  # set when the request failed alone
    cache: SequenceCache | None = None  # slot + pages while RUNNING
    job: PrefillJob | None = None  # while prefilling
    swapped: dict | None = None  # host copy of the cache while PREEMPTED
    cached_tokens: int = 0  # prompt tokens whose state came from the prefix cache
    replayed_tokens: int = 0  # cached tokens run through the encoder again (window rebuild)
    prefill_ms: float = 0.0
    decode_s: float = 0.0
    spec_tokens: float | None = None  # tokens per verification of this sequence, moving average (CostModel)
    arrival: float = field(default_factory=time.perf_counter)
    n_preemptions: int = 0

    # ------------------------------------------------------------------ views
    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prefilling(self) -> bool:
        return self.job is not None

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV the cache holds."""
        return 0 if self.cache is None else self.cache.n_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def slot(self) -> int | None:
        return None if self.cache is None or self.cache.released else self.cache.slot

    @property
    def page_ids(self) -> dict[int, list[int]]:
        return {} if self.cache is None else self.cache.pages

    def target_tokens(self) -> int:
        """Tokens the cache will hold once the current prefill (if any) is done."""
        if self.job is not None:
            return self.job.n_total
        return self.num_cached_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.id}, status={self.status.value}, prompt={len(self.prompt)}, "
                f"output={len(self.output)}, cached={self.num_cached_tokens})")
