"""`weights="as-released"`: run the model as the release's own inference code runs its checkpoint.

The float model stays the default (training, and what tests compare against). `as_released(model)`
changes it in place from the outside — a module swap, as gpt-fast's `quantize.py` does — so
that every tensor takes the form the release stores it in (`dsv41.checkpoint.release_format`)
and computes the way `inference/model.py` computes with it (SPEC §1a "weights"):

* linears stored FP8 (attention `wq_a`, `wq_b`, `wkv`, `wo_b`; indexer `wq_b`; the shared expert;
  Engram `wkv`) become `FP8Linear`: the input is quantized per 1×32 block to E4M3 with a
  power-of-two scale (`quant.fp8_gemm.act_quant`) and multiplied with the E4M3 weight and its 32×32
  tile scales, accumulating in fp32 — the Triton kernel on CUDA (`quant.fp8_gemm_triton`), the
  torch twin elsewhere (`DSV41_KERNELS=torch` forces the twin);
* `attn.wo_a` is stored FP8 but the reference dequantizes it to BF16 (convert.py) and runs its
  grouped einsum unquantized: its weight is rounded through FP8 and stays a plain weight;
* Engram tables become `FP8RowTable`: E4M3 rows with an E8M0 scale per 32 channels, gathered and
  dequantized per lookup (the table is never held in float). Its rows feed the FP8 `wkv`, whose
  activation quantization reproduces the stored codes and scales exactly (each 32-channel block
  of a dequantized row re-quantizes to itself), so this equals feeding the rows with their own
  scales into the FP8 product — which is the reference's computation;
* tensors stored BF16 (embedding, head, router, compressor, index-key projection, norms, Engram
  q/k weights) are rounded to BF16 values; FP32 ones (mHC, sinks, gate biases) stay.
* the routed experts (`model.moe.GroupedExperts`) become `MXFP4Experts`: packed E2M1 weights with
  an E8M0 scale per 32 along K, stacked per projection; the expert-sorted rows are quantized as
  above and multiplied with every expert's E2M1 weights cast to E4M3 in the GEMM's prologue
  (`quant.fp4_gemm`: one Triton launch for all experts on CUDA, no host sync; the torch twin
  elsewhere), SwiGLU in fp32 between, the hidden re-quantized before `w2` — the release's
  `fp4_gemm` path.

`load_checkpoint(..., weights="as-released")` builds the same modules on the meta device
(`swap_released_modules`) and fills them with the file's FP8 codes and scales, never a float copy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dsv41.checkpoint.release_format import BF16, BLOCK, FP8_ROWS, FP8_TILES, MXFP4, storage_of
from dsv41.model.moe import GroupedExperts, _swiglu
from dsv41.quant.fp4 import mxfp4_dequantize_weight, mxfp4_quantize_weight
from dsv41.quant.fp4_gemm import fp4_experts_twin
from dsv41.quant.fp8 import (
    fp8_block_dequantize_weight,
    fp8_block_quantize_weight,
    fp8_row_dequantize,
    fp8_row_quantize,
)
from dsv41.quant.fp8_gemm import act_quant, fp8_gemm_twin

# stored FP8 but run as a dequantized BF16 weight by the reference (convert.py dequantizes it)
WEIGHT_ONLY_FP8 = ("attn.wo_a",)


def _use_triton(*tensors: Tensor) -> bool:
    """The kernel boundary's rule (`dsv41.kernels.ops`): Triton on CUDA unless `torch` is forced."""
    from dsv41.kernels import ops

    choice = ops.backend()
    if choice == "torch" or not ops.HAVE_TRITON:
        return False
    return choice == "triton" or all(t.is_cuda for t in tensors)


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """The release's FP8 linear: x (..., K) → (..., N) in x's dtype; weight (N, K) E4M3, scale the
    E8M0 32×32 tile scales (ceil(N/32), ceil(K/32))."""
    n, k = weight.shape
    flat = x.reshape(-1, k)  # (M, K)
    xq, xs = act_quant(flat)
    if _use_triton(xq, weight):
        from dsv41.quant.fp8_gemm_triton import fp8_gemm_triton

        out = fp8_gemm_triton(xq, xs, weight, scale, x.dtype)
    else:
        out = fp8_gemm_twin(xq, xs, weight, scale, x.dtype)
    return out.reshape(*x.shape[:-1], n)  # (..., N)


class _StoredBuffers(nn.Module):
    """Holds its buffers in the release's dtypes (float8_e4m3fn, float8_e8m0fnu, int8). `model.to(dtype)`
    casts every floating tensor, float8 included: here only devices move, never the formats."""

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # an integer probe shows where `fn` sends tensors without casting it
        first = next(iter(self._buffers.values()))
        device = fn(torch.empty(0, dtype=torch.uint8, device=first.device)).device
        for name, buf in self._buffers.items():
            self._buffers[name] = buf.to(device)
        return self


class FP8Linear(_StoredBuffers):
    """nn.Linear (no bias) whose weight is the release's: `weight` E4M3 (out, in), `scale` E8M0 per 32×32 tile."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("scale", torch.empty(math.ceil(out_features / BLOCK), math.ceil(in_features / BLOCK),
                                                  dtype=torch.float8_e8m0fnu, device=device))

    @classmethod
    def from_float(cls, linear: nn.Linear) -> FP8Linear:
        """Quantize a float linear's weight by the release's rule (`fp8_block_quantize_weight`)."""
        if linear.bias is not None:
            raise ValueError("FP8Linear: the release's FP8 linears have no bias")
        module = cls(linear.in_features, linear.out_features, device=linear.weight.device)
        codes, scale = fp8_block_quantize_weight(linear.weight.detach())
        module.weight, module.scale = codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)
        return module

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return fp8_block_dequantize_weight(self.weight, self.scale, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 32x32 blocks"


class FP8RowTable(_StoredBuffers):
    """nn.Embedding whose table is the release's: `weight` E4M3 (rows, dim), `scale` E8M0 (rows, ceil(dim/32))."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device: torch.device | str | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("scale", torch.empty(num_embeddings, math.ceil(embedding_dim / BLOCK),
                                                  dtype=torch.float8_e8m0fnu, device=device))

    @classmethod
    def from_float(cls, embedding: nn.Embedding) -> FP8RowTable:
        module = cls(embedding.num_embeddings, embedding.embedding_dim, device=embedding.weight.device)
        codes, scale = fp8_row_quantize(embedding.weight.detach())
        module.weight, module.scale = codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)
        return module

    def forward(self, ids: Tensor) -> Tensor:
        """ids (...) → rows (..., dim) fp32, dequantized from the gathered codes and scales (exact)."""
        codes = self.weight.view(torch.uint8)[ids]  # (..., dim): gather bytes, not floats
        scales = self.scale.view(torch.uint8)[ids]  # (..., ceil(dim/32))
        return fp8_row_dequantize(codes, scales)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fp8 rows, scale per 32"


_PROJECTIONS = ("w1", "w2", "w3")


def _split_codes(module: MXFP4Experts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: stacked `w1` / `w1_scale` (E, ...) → the release's `0.w1.weight`, `0.w1.scale`, ..."""
    stacked = {w: (state_dict.pop(prefix + w), state_dict.pop(prefix + w + "_scale")) for w in _PROJECTIONS}
    for i in range(module.n_experts):
        for w in _PROJECTIONS:
            state_dict[f"{prefix}{i}.{w}.weight"] = stacked[w][0][i]
            state_dict[f"{prefix}{i}.{w}.scale"] = stacked[w][1][i]


def _stack_codes(module: MXFP4Experts, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                 missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """load_state_dict pre-hook: the per-expert `X.weight` / `X.scale` → one stacked buffer each (all E
    present: stacked; otherwise every absent one is reported missing by its official name)."""
    for w in _PROJECTIONS:
        for leaf, buf in (("weight", w), ("scale", w + "_scale")):
            names = [f"{prefix}{i}.{w}.{leaf}" for i in range(module.n_experts)]
            if all(n in state_dict for n in names):
                state_dict[prefix + buf] = torch.stack([state_dict.pop(n) for n in names])
            else:
                missing_keys.extend(n for n in names if n not in state_dict)
                for n in names:
                    state_dict.pop(n, None)
                module._reported_missing.add(prefix + buf)


def _drop_stacked(module: MXFP4Experts, incompatible_keys) -> None:
    for name in module._reported_missing:
        while name in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(name)
    module._reported_missing.clear()


class MXFP4Experts(_StoredBuffers):
    """The routed experts as the release stores them: `w1`, `w3` (E, inter, dim/2) and `w2` (E, dim,
    inter/2) packed E2M1 pairs (int8, element 2i in the low nibble), `w*_scale` (E, out, in/32) E8M0.
    Same forward contract as `GroupedExperts`; the state dict holds the release's per-expert names."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, swiglu_limit: float = 0.0,
                 device: torch.device | str | None = None):
        super().__init__()
        self.n_experts, self.dim, self.inter_dim, self.swiglu_limit = n_experts, dim, inter_dim, swiglu_limit
        for w, (out_dim, in_dim) in zip(_PROJECTIONS, ((inter_dim, dim), (dim, inter_dim), (inter_dim, dim))):
            self.register_buffer(w, torch.empty(n_experts, out_dim, in_dim // 2, dtype=torch.int8, device=device))
            self.register_buffer(w + "_scale", torch.empty(n_experts, out_dim, in_dim // BLOCK,
                                                           dtype=torch.float8_e8m0fnu, device=device))
        self._reported_missing: set[str] = set()
        self.register_state_dict_post_hook(_split_codes)
        self.register_load_state_dict_pre_hook(_stack_codes)
        self.register_load_state_dict_post_hook(_drop_stacked)

    @classmethod
    def from_grouped(cls, experts: GroupedExperts) -> MXFP4Experts:
        """Quantize stacked float experts by the release's rule (`mxfp4_quantize_weight`)."""
        module = cls(experts.n_experts, experts.dim, experts.inter_dim, experts.swiglu_limit,
                     device=experts.w1.device)
        for w in _PROJECTIONS:
            packed, scale = mxfp4_quantize_weight(getattr(experts, w).detach())
            setattr(module, w, packed.view(torch.int8))
            setattr(module, w + "_scale", scale.view(torch.float8_e8m0fnu))
        return module

    def _product(self, xq: Tensor, xs: Tensor, w: str, counts: Tensor, out_dtype: torch.dtype) -> Tensor:
        packed, scale = getattr(self, w), getattr(self, w + "_scale")
        if _use_triton(xq, packed):
            from dsv41.quant.fp4_gemm_triton import fp4_experts_triton

            return fp4_experts_triton(xq, xs, packed, scale, counts, out_dtype)
        return fp4_experts_twin(xq, xs, packed, scale, counts, out_dtype)

    def forward(self, xs: Tensor, ws: Tensor, counts: Tensor, grouped: bool = True) -> Tensor:
        """xs (M, dim) rows sorted by expert, ws (M, 1) fp32 routing weights, counts (E,) → (M, dim)."""
        xq, sx = act_quant(xs)  # one quantization feeds w1 and w3, as the reference's expert(x)
        h = _swiglu(self._product(xq, sx, "w1", counts, xs.dtype), self._product(xq, sx, "w3", counts, xs.dtype),
                    self.swiglu_limit, ws)
        hq, sh = act_quant(h.to(xs.dtype))  # the reference: self.w2(x.to(dtype))
        return self._product(hq, sh, "w2", counts, xs.dtype)

    def dense(self, x: Tensor, route: Tensor) -> Tensor:
        """Every expert on every row, weighted by `route` (N, E) fp32 (0 where not chosen): x (N, dim) →
        Σ_e route_e · expert_e(x) (N, dim) fp32 — `GroupedExperts.dense`'s contract, for the engine's
        CUDA-graph decode with few experts. The rows are quantized once and handed to the same product as
        E full segments (counts built on the device: static shapes, no host read on the kernel path); an
        unchosen expert's hidden is 0 × SwiGLU, which quantizes to zero codes, so it adds exactly 0."""
        n, e = x.shape[0], self.n_experts
        xq, sx = act_quant(x)  # (N, dim) codes, (N, dim/32) scales: each expert sees the same rows
        xq_all, sx_all = xq.repeat(e, 1), sx.repeat(e, 1)  # (E·N, dim), (E·N, dim/32): expert-major segments
        counts = torch.full((e,), n, dtype=torch.long, device=x.device)  # (E,)
        ws = route.t().reshape(e * n, 1)  # (E·N, 1): row j of segment i takes route[j, i]
        h = _swiglu(self._product(xq_all, sx_all, "w1", counts, x.dtype),
                    self._product(xq_all, sx_all, "w3", counts, x.dtype), self.swiglu_limit, ws)
        hq, sh = act_quant(h.to(x.dtype))
        out = self._product(hq, sh, "w2", counts, x.dtype)  # (E·N, dim)
        return out.view(e, n, -1).float().sum(0)  # (N, dim) fp32

    def extra_repr(self) -> str:
        return f"{self.n_experts} experts, dim {self.dim}, inter {self.inter_dim}, mxfp4"


# ---------------------------------------------------------------------- the swap
def _runs_fp8(name: str) -> bool:
    """Does the reference run this module as an FP8 GEMM (rather than a dequantized weight)?"""
    return not name.endswith(WEIGHT_ONLY_FP8)


def _released_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every nn.Linear / nn.Embedding the release stores and runs in FP8, and of
    every stack of routed experts (MXFP4)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and storage_of(f"{name}.weight") == FP8_TILES and _runs_fp8(name):
            out.append((name, module))
        elif isinstance(module, nn.Embedding) and storage_of(f"{name}.weight") == FP8_ROWS:
            out.append((name, module))
        elif isinstance(module, GroupedExperts) and storage_of(f"{name}.0.w1.weight") == MXFP4:
            out.append((name, module))
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, new)


def swap_released_modules(model: nn.Module, quantize: bool = True) -> nn.Module:
    """Replace the FP8 linears and tables by `FP8Linear` / `FP8RowTable`, quantizing their float
    weights (`quantize=True`) or leaving them empty on the meta device (a skeleton the loader fills)."""
    for name, module in _released_targets(model):
        if isinstance(module, GroupedExperts):
            new = MXFP4Experts.from_grouped(module) if quantize else MXFP4Experts(
                module.n_experts, module.dim, module.inter_dim, module.swiglu_limit, device="meta")
        elif isinstance(module, nn.Linear):
            new = FP8Linear.from_float(module) if quantize else FP8Linear(module.in_features, module.out_features,
                                                                         device="meta")
        else:
            new = FP8RowTable.from_float(module) if quantize else FP8RowTable(module.num_embeddings,
                                                                             module.embedding_dim, device="meta")
        _replace(model, name, new)
    return model


@torch.no_grad()
def round_as_stored(name: str, value: Tensor) -> Tensor:
    """A float tensor's value after a trip through the release's storage of `name` (same dtype):
    BF16 rounding, FP8 tiles (weight-only `wo_a`), MXFP4 (routed experts); FP32 unchanged."""
    storage = storage_of(name)
    if storage == BF16:
        return value.to(torch.bfloat16).to(value.dtype)
    if storage == FP8_TILES:
        return fp8_block_dequantize_weight(*fp8_block_quantize_weight(value), dtype=value.dtype)
    if storage == MXFP4:
        return mxfp4_dequantize_weight(*mxfp4_quantize_weight(value), dtype=value.dtype)
    return value


@torch.no_grad()
def as_released(model: nn.Module) -> nn.Module:
    """Make `model` (a float Transformer) compute as the release does with its checkpoint; in place,
    returns the model. Applying it twice changes nothing the second time."""
    swap_released_modules(model, quantize=True)
    for name, p in model.named_parameters():
        p.copy_(round_as_stored(name, p))
    return model


def is_released(model: nn.Module) -> bool:
    return any(isinstance(m, (FP8Linear, FP8RowTable, MXFP4Experts)) for m in model.modules())


def coded_tensors(model: nn.Module) -> dict[str, tuple[str, Tensor, Tensor]]:
    """Official name → (storage form, codes, scales) of every tensor an as-released module holds in
    the release's form (FP8 linears, FP8 rows, MXFP4 experts, one entry per expert matrix)."""
    out: dict[str, tuple[str, Tensor, Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, (FP8Linear, FP8RowTable)):
            out[f"{name}.weight"] = (FP8_ROWS if isinstance(m, FP8RowTable) else FP8_TILES, m.weight, m.scale)
        elif isinstance(m, MXFP4Experts):
            for i in range(m.n_experts):
                for w in _PROJECTIONS:
                    out[f"{name}.{i}.{w}.weight"] = (MXFP4, getattr(m, w)[i], getattr(m, w + "_scale")[i])
    return out
