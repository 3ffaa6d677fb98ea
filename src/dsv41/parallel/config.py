"""ParallelConfig: how many ranks each kind of parallelism takes, parsed from `dp=2,ep=2,pp=2,cp=1`.

    world = pp · dp · cp
    dp      data parallel, parameters fully sharded over the dp·cp data ranks (FSDP2)
    cp      context parallel: each sequence split into cp contiguous chunks
    pp      pipeline stages, cut between blocks
    ep      expert parallel: routed experts split over ep of the dp·cp data ranks (ep | dp·cp)
    engram  1 = Engram tables row-sharded over the stage's dp·cp data ranks, lookups by all-to-all
            (default when dp·cp > 1); 0 = tables sharded by FSDP like any parameter
    microbatches  pipeline micro-batches per step and rank (default pp)
    schedule      "1f1b" (default) or "gpipe"
    mixed   "fp32" (default) or "bf16" FSDP2 parameter dtype (reductions stay fp32)
    ship_index_keys  1 = the pipeline payload carries index keys; 0 (default) = shadow indexers
            re-derive them on the consumer's stage from the shipped pre-RoPE entries
    cuts    first layer of stages 1..pp-1, colon-separated (cuts=5 for pp=2); default: even split

Mistakes are one ConfigError naming the key (exit code 2 in the CLI).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from dsv41.config import ConfigError

_INT_KEYS = ("dp", "cp", "pp", "ep", "engram", "microbatches", "ship_index_keys")
_ALIASES = {"fsdp": "dp", "mb": "microbatches"}


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1  # data-parallel (FSDP2) degree
    cp: int = 1  # context-parallel degree (sequence split)
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert-parallel degree, a divisor of dp·cp
    engram: int = -1  # 1 = engram-parallel tables, 0 = FSDP, -1 = 1 when dp·cp > 1
    microbatches: int = 0  # pipeline micro-batches per step (0 = pp)
    schedule: str = "1f1b"  # pipeline schedule: "1f1b" or "gpipe"
    mixed: str = "fp32"  # FSDP2 compute dtype of parameters: "fp32" or "bf16"
    ship_index_keys: int = 0  # 1: index keys travel in the pipeline payload instead of shadow indexers
    cuts: tuple[int, ...] = ()  # first layer of pipeline stages 1..pp-1 (default: layers split evenly)

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel option '{name}': must be >= 1, got {getattr(self, name)}")
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(f"parallel option 'ep': {self.ep} must divide dp·cp = {self.dp * self.cp}")
        if self.engram not in (-1, 0, 1):
            raise ConfigError(f"parallel option 'engram': must be 0 or 1, got {self.engram}")
        if self.microbatches < 0:
            raise ConfigError(f"parallel option 'microbatches': must be >= 0, got {self.microbatches}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ConfigError(f"parallel option 'schedule': must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if self.mixed not in ("fp32", "bf16"):
            raise ConfigError(f"parallel option 'mixed': must be 'fp32' or 'bf16', got {self.mixed!r}")
        cuts = list(self.cuts)
        if cuts and (len(cuts) != self.pp - 1 or cuts != sorted(set(cuts)) or cuts[0] < 1):
            raise ConfigError(f"parallel option 'cuts': need pp-1 = {self.pp - 1} increasing first layers, "
                              f"got {self.cuts}")
        if self.ship_index_keys not in (0, 1):
            raise ConfigError(f"parallel option 'ship_index_keys': must be 0 or 1, got {self.ship_index_keys}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks of one pipeline stage (they split batches and sequences)."""
        return self.dp * self.cp

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or self.pp

    @property
    def engram_sharded(self) -> bool:
        return self.engram == 1 or (self.engram == -1 and self.data_ranks > 1)

    def __str__(self) -> str:
        def show(v):
            return ":".join(map(str, v)) if isinstance(v, tuple) else v

        return ",".join(f"{f.name}={show(getattr(self, f.name))}" for f in fields(self))

    def stage_layers(self, n_layers: int) -> list[range]:
        """The layers of each pipeline stage."""
        if self.cuts:
            if self.cuts[-1] >= n_layers:
                raise ConfigError(f"parallel option 'cuts': {self.cuts} must lie below n_layers = {n_layers}")
            bounds = [0, *self.cuts, n_layers]
        else:
            if self.pp > n_layers:
                raise ConfigError(f"parallel option 'pp': {self.pp} stages for {n_layers} layers")
            bounds = [round(i * n_layers / self.pp) for i in range(self.pp + 1)]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def parse_parallel(text: str) -> ParallelConfig:
    """'dp=2,ep=2,pp=2,cp=1' → ParallelConfig (unknown keys and bad values raise ConfigError)."""
    values: dict[str, int | str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, raw = item.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        if not eq:
            raise ConfigError(f"parallel option '{item}': expected key=value (e.g. dp=2,pp=2)")
        if key in _INT_KEYS:
            try:
                values[key] = int(raw)
            except ValueError:
                raise ConfigError(f"parallel option '{key}': expected an int, got {raw!r}") from None
        elif key in ("schedule", "mixed"):
            values[key] = raw.strip().lower()
        elif key == "cuts":
            try:
                values[key] = tuple(int(v) for v in raw.split(":") if v.strip())
            except ValueError:
                raise ConfigError(f"parallel option 'cuts': expected first layers like 5:9, got {raw!r}") from None
        else:
            raise ConfigError(f"parallel option '{key}': unknown (keys: dp, cp, pp, ep, engram, microbatches, "
                              "schedule, mixed, ship_index_keys, cuts)")
    return ParallelConfig(**values)  # type: ignore[arg-type]
