"""Loading a checkpoint: a meta-device skeleton filled one tensor at a time, float or as released.

`load_checkpoint` builds the model with its parameters on the meta device (buffers — pure functions
of the config — are built for real; tensor factories of >= 4M elements go straight to meta, so even
an Engram table larger than host memory is never allocated, and initializers are skipped), checks
every header against it before reading any data, then streams the tensors in, one top-level block at
a time: each tensor is read from its shard, decoded on the target device and handed to the model
(`load_state_dict(assign=True)`), so host memory holds one tensor at a time, never a full copy.

`weights="float"` (default) dequantizes FP8 / MXFP4 to float. `weights="as-released"` first swaps
in the release's modules (`dsv41.model.released`): FP8 linears and Engram tables take the file's
E4M3 codes and E8M0 scales as they are (re-encoded by the release rule only when the file holds
another form, e.g. a float checkpoint), every other tensor is rounded the way the release stores
it. Parameter dtypes follow `model.to(dtype)` (modules that pin a parameter to FP32, like the
router's bias, keep it; the FP8 buffers keep their formats); buffers keep the dtype their module
gave them. Loaded tensors are copies, never views of the file's mapping, so rewriting a file later
cannot change a live model. `mtp.*` and vision tensors are skipped with a logged note while the
model builds no such modules.

The DSpark drafter (`mtp.*`, `dsv41.model.dspark`): `load_checkpoint(drafter=None)` builds the draft
stages and loads them under their official names whenever the config has a drafter and the checkpoint
holds `mtp.*` tensors (`drafter=True` insists, `False` skips them); they end up registered as
`model.mtp` (`drafter_of(model)` wraps them). `load_drafter(directory, main)` reads only the `mtp.*`
tensors of a directory — a drafter saved alone (`<model>/dspark/`, docs/dspark.md) or a whole release
checkpoint — into a `DSpark` bound to `main`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dsv41.checkpoint.codec import FLOAT_DTYPES, decode, logical_names, release_codes
from dsv41.checkpoint.files import CONFIG_NAME, CheckpointError, TensorStore
from dsv41.checkpoint.release_format import MXFP4, QUANTIZED, ReleaseFormatError, scale_name, storage_of, stored_layout
from dsv41.config import ConfigError, ModelConfig, load_config
from dsv41.model.dspark import DSpark
from dsv41.model.released import as_released, coded_tensors, round_as_stored, swap_released_modules
from dsv41.model.transformer import Transformer

logger = logging.getLogger("dsv41.checkpoint")

Weights = Literal["float", "as-released"]

# tensors of modules the text model does not build yet: skipped (with a note) when absent from the model
_OPTIONAL_PREFIXES = ("mtp.", "vision.", "visual.", "vision_model.", "vision_tower.", "vit.", "projector.",
                      "mm_projector.", "aligner.")


def _few(names: list[str], k: int = 5) -> str:
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


# ---------------------------------------------------------------------- model construction
_LARGE_NUMEL = 1 << 22  # factory calls this large (16 MiB in fp32) are only ever parameters here
_FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn)
# in-place initializers (and all of torch.nn.init): no-ops on a meta tensor (skipping them also skips
# torch's slow first-use import of the meta implementations)
_INITIALIZERS = (Tensor.normal_, Tensor.uniform_, Tensor.zero_, Tensor.fill_, Tensor.random_, Tensor.copy_)


class _SkeletonMode(TorchFunctionMode):
    """Tensor factories without an explicit device that ask for >= _LARGE_NUMEL elements go to meta,
    so a parameter larger than host memory (an Engram table) is never allocated, not even lazily;
    initializers applied to meta tensors do nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _INITIALIZERS or getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
            if isinstance(target, Tensor) and target.is_meta:
                return target
        if func in _FACTORIES and kwargs.get("device") is None:
            size = kwargs.get("size", args[0] if args else ())
            dims = size if isinstance(size, (tuple, list, torch.Size)) else [a for a in args if isinstance(a, int)]
            if all(isinstance(d, int) for d in dims) and math.prod(dims) >= _LARGE_NUMEL:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _build_skeleton(config: ModelConfig, build: Callable[[ModelConfig], nn.Module] = Transformer) -> Any:
    """`build(config)` (the Transformer, or the DSpark drafter) with every parameter on the meta device
    (initializers run there, for free) and its buffers — pure functions of the config — built for real.
    Patches `nn.Module.register_parameter` while it runs, so it is not thread-safe."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with _SkeletonMode():
            model = build(config)
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
    for name, buf in model.named_buffers():
        if buf.device.type == "meta":
            raise RuntimeError(f"load_checkpoint: buffer {name} {list(buf.shape)} is too large to build on the host "
                               f"while the parameters stay on meta")
    return model


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for parameters (module `_apply` overrides honoured); buffers keep theirs."""
    buffers = dict(model.named_buffers())
    model.to(dtype)
    for name, buf in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buf


def read_config(directory: str | Path) -> ModelConfig:
    """The config of a checkpoint directory (flat preset-style or the release's HF config.json)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_config(path)
    except (ConfigError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _check_directory(directory: str | Path) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    return directory


def _block_of(name: str) -> str:
    """The top-level block a tensor belongs to (`layers.7`, `embed`, ...): the unit of streaming."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else parts[0]


# ---------------------------------------------------------------------- load
def load_checkpoint(directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    config: ModelConfig | None = None, strict: bool = True, weights: Weights = "float",
                    drafter: bool | None = None) -> Transformer:
    """Build a Transformer from a checkpoint directory (see the module docstring).

    strict=True: every model tensor must be present and nothing else (besides skipped `mtp.*` /
    vision tensors); the model is materialized from the checkpoint alone. strict=False: the model
    is initialized (`init_weights`) and the tensors present are copied in; the rest is logged.
    drafter: None = build the DSpark stages (`model.mtp`) when the config has a drafter and the
    checkpoint holds `mtp.*` tensors; True = always (config must have one); False = never."""
    if not dtype.is_floating_point:
        raise ValueError(f"load_checkpoint: dtype must be a floating dtype, got {dtype}")
    if weights not in ("float", "as-released"):
        raise ValueError(f"load_checkpoint: weights must be 'float' or 'as-released', got {weights!r}")
    directory = _check_directory(directory)
    config = config or read_config(directory)
    device = torch.device(device)
    released = weights == "as-released" and strict  # strict=False: load float, then convert (below)
    if drafter and not config.dspark_block_size:
        raise CheckpointError(f"{directory}: drafter=True but the config has no DSpark drafter (dspark_block_size 0)")
    with TensorStore(directory) as store:
        logical = logical_names(store)
        if drafter is None:
            drafter = bool(config.dspark_block_size) and any(n.startswith("mtp.") for n in logical)
        if strict:
            model = _build_skeleton(config)
            if drafter:
                model.mtp = _build_skeleton(config, DSpark).mtp
            if released:
                swap_released_modules(model, quantize=False)
        else:
            model = Transformer(config).init_weights()
            if drafter:
                DSpark(config).init_weights().attach(model)
        _cast_parameters(model, dtype)
        expected = model.state_dict()
        coded = {n: form for n, (form, _, _) in coded_tensors(model).items()}  # kept in the release's form
        wanted = [n for n in expected if n not in {scale_name(c) for c in coded}]  # logical names

        built = {p for p in _OPTIONAL_PREFIXES if any(n.startswith(p) for n in expected)}
        skipped = sorted(n for n in logical if n not in expected and n.startswith(_OPTIONAL_PREFIXES)
                         and not n.startswith(tuple(built)))
        if skipped:
            logger.info("%s: skipping %d tensors of modules this model does not build (%s)", directory,
                        len(skipped), _few(skipped, 3))
        unexpected = sorted(n for n in logical if n not in expected and n not in skipped)
        missing = sorted(n for n in wanted if n not in logical)
        if unexpected or missing:
            parts = ([f"missing {len(missing)} tensors: {_few(missing)}"] if missing else []) + \
                    ([f"unexpected {len(unexpected)} tensors: {_few(unexpected)}"] if unexpected else [])
            message = f"{directory}: checkpoint does not match the model: " + "; ".join(parts)
            if strict:
                raise CheckpointError(message)
            logger.warning("%s", message)
        names = [n for n in wanted if n in logical]
        for name in names:  # all headers are checked before any data is read
            shape, kind, problem = logical[name]
            if problem:
                raise CheckpointError(f"{store.entries[name][0]}: {problem}")
            want = tuple(expected[name].shape)
            if coded.get(name) == MXFP4:  # packed pairs: the logical matrix is twice as wide
                want = (want[0], want[1] * 2)
            if tuple(shape) != want:
                raise CheckpointError(f"{store.entries[name][0]}: tensor {name} has shape {list(shape)}, the model "
                                      f"expects {list(want)}")
            stored = store.entries[name][1]
            if name not in coded and expected[name].is_floating_point() and kind is None \
                    and stored not in FLOAT_DTYPES:
                raise CheckpointError(f"{store.entries[name][0]}: tensor {name} has dtype {stored}, expected a float")
        # stream: one top-level block at a time, each tensor decoded straight onto `device`
        for _, group in itertools.groupby(names, key=_block_of):
            batch: dict[str, Tensor] = {}
            for name in group:
                kind = logical[name][1]
                if name in coded:
                    batch[name], batch[scale_name(name)] = release_codes(store, name, kind, coded[name], device)
                    continue
                value = decode(store, name, kind, device, expected[name].dtype)
                batch[name] = round_as_stored(name, value) if released and value.is_floating_point() else value
            model.load_state_dict(batch, strict=False, assign=strict)
            del batch
    model = model.to(device)
    if weights == "as-released" and not strict:
        as_released(model)
    return model


def load_drafter(directory: str | Path, main: Transformer, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> DSpark:
    """The DSpark drafter stored in `directory` (its `mtp.*` tensors; any others are ignored), bound to
    `main`. The directory's config must agree with `main`'s on the backbone widths; the drafter's own
    fields (stages, block, targets, experts) come from it. Device and dtype default to `main`'s."""
    directory = _check_directory(directory)
    config = read_config(directory)
    if not config.dspark_block_size:
        raise CheckpointError(f"{directory}: the config has no DSpark drafter (dspark_block_size 0)")
    for key in ("dim", "vocab_size", "hc_mult", "n_layers"):
        if getattr(config, key) != getattr(main.config, key):
            raise CheckpointError(f"{directory}: drafter built for {key}={getattr(config, key)}, the model has "
                                  f"{getattr(main.config, key)}")
    ref = next(main.parameters())
    device = torch.device(device) if device is not None else ref.device
    dtype = dtype or ref.dtype
    with TensorStore(directory) as store:
        logical = {n: v for n, v in logical_names(store).items() if n.startswith("mtp.")}
        drafter = _build_skeleton(config, DSpark)
        _cast_parameters(drafter, dtype)
        expected = drafter.state_dict()
        missing = sorted(n for n in expected if n not in logical)
        unexpected = sorted(n for n in logical if n not in expected)
        if missing or unexpected:
            parts = ([f"missing {len(missing)} tensors: {_few(missing)}"] if missing else []) + \
                    ([f"unexpected {len(unexpected)} tensors: {_few(unexpected)}"] if unexpected else [])
            raise CheckpointError(f"{directory}: drafter does not match its config: " + "; ".join(parts))
        for _, group in itertools.groupby(sorted(expected), key=_block_of):
            batch: dict[str, Tensor] = {}
            for name in group:
                shape, kind, problem = logical[name]
                if problem:
                    raise CheckpointError(f"{store.entries[name][0]}: {problem}")
                if tuple(shape) != tuple(expected[name].shape):
                    raise CheckpointError(f"{store.entries[name][0]}: tensor {name} has shape {list(shape)}, the "
                                          f"drafter expects {list(expected[name].shape)}")
                batch[name] = decode(store, name, kind, device, expected[name].dtype)
            drafter.load_state_dict(batch, strict=False, assign=True)
    return drafter.to(device).bind(main)


def read_state_dict(directory: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """All logical tensors of a checkpoint, dequantized (quantized ones in fp32, others as stored,
    or all floats in `dtype`); no model is built and nothing is checked against one."""
    directory = _check_directory(directory)
    device = torch.device(device)
    out = {}
    with TensorStore(directory) as store:
        for name, (_, kind, problem) in logical_names(store).items():
            if problem:
                raise CheckpointError(f"{store.entries[name][0]}: {problem}")
            out[name] = decode(store, name, kind, device, dtype)
    return out


# ---------------------------------------------------------------------- info
def release_layout_problems(store: TensorStore) -> list[str]:
    """Every way the stored tensors differ from the release table (`release_format`): a tensor the
    table does not cover, a stored name, dtype or shape other than the table's. Empty = conforms."""
    problems = []
    consumed: set[str] = set()
    for name, (shape, _, _) in logical_names(store).items():
        try:
            layout = stored_layout(name, shape)
        except ReleaseFormatError as e:
            problems.append(str(e))
            continue
        for stored_name, dt, stored_shape in layout:
            consumed.add(stored_name)
            if stored_name not in store.entries:
                problems.append(f"{stored_name}: missing (the release stores {name} as {storage_of(name)})")
                continue
            _, have_dt, have_shape = store.entries[stored_name]
            if (have_dt, tuple(have_shape)) != (dt, tuple(stored_shape)):
                problems.append(f"{stored_name}: {have_dt} {list(have_shape)}, the release stores {dt} "
                                f"{list(stored_shape)}")
    problems += [f"{n}: not a tensor of the release layout" for n in store.entries if n not in consumed]
    return problems


def checkpoint_info(directory: str | Path) -> dict[str, Any]:
    """What a checkpoint holds, from the headers alone: config summary, files, tensor count, bytes,
    dtype histogram, format, whether it matches the release layout, metadata. For a CLI to print."""
    directory = _check_directory(directory)
    config = read_config(directory)
    with TensorStore(directory) as store:
        dtypes: dict[str, dict[str, int]] = {}
        for name, (_, dt, _) in store.entries.items():
            slot = dtypes.setdefault(dt, {"tensors": 0, "bytes": 0})
            slot["tensors"] += 1
            slot["bytes"] += store.nbytes[name]
        logical = logical_names(store)
        quantized = {kind for _, kind, _ in logical.values() if kind in QUANTIZED}
        problems = release_layout_problems(store)
        return {
            "directory": str(directory),
            "config": {
                "n_layers": config.n_layers, "dim": config.dim, "vocab_size": config.vocab_size,
                "n_heads": config.n_heads, "n_routed_experts": config.n_routed_experts,
                "n_activated_experts": config.n_activated_experts, "n_mtp_layers": config.n_mtp_layers,
                "vision_n_layers": config.vision_n_layers, "dtype": config.dtype, "expert_dtype": config.expert_dtype,
            },
            "format": "official-fp8" if quantized else "float",
            "quantized": sorted(quantized),
            "release_layout": {"conforms": not problems, "problems": len(problems), "first": problems[:5]},
            "files": [p.name for p in store.files],
            "tensors": len(store.entries),
            "logical_tensors": len(logical),
            "bytes": sum(store.nbytes.values()),
            "dtypes": dict(sorted(dtypes.items())),
            "metadata": dict(store.metadata),
        }
