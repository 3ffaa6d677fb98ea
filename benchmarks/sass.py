"""Compile a benchmark case's Triton kernels for the H200 (sm_90a) on any machine — no GPU needed —
and report what the compiler made of them: registers, spills, shared memory, and the SASS
instruction mix (tensor-core ops, global / shared / local memory ops, barriers).

    python benchmarks/sass.py attention "decode B=64"
    python benchmarks/sass.py indexer "scores decode 1M" --knobs '{"block_n": 256}' --dump /tmp/sass

The case's inputs are built on the CPU (`benchmarks/kernel_cases/<family>.py`, scaled as they are);
every `kernel[grid](...)` the launcher makes is compiled with Triton's own argument specialization
(16-byte alignment, divisibility) for `cuda:90` instead of being run. `ptxas -v` gives registers,
spills and the stack frame; `cuobjdump -sass` the instructions. Use it before spending device time:
spills, `LDL`/`STL`, missing `HGMMA`/`QGMMA` or 4-byte global loads are visible here.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("benchmarks/sass.py compiles for the GPU: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime import jit  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
GROUPS = {  # SASS opcode (before the first '.') → group reported
    "tensor core": ("HGMMA", "QGMMA", "HMMA", "IMMA", "WARPGROUP"),
    "global load": ("LDG", "LDGSTS", "UTMALDG"),
    "global store": ("STG", "UTMASTG", "RED", "ATOM"),
    "shared": ("LDS", "STS", "LDSM", "STSM"),
    "local (spill)": ("LDL", "STL"),
    "sync": ("BAR", "SYNCS", "DEPBAR", "WARPSYNC"),
    "fp32": ("FFMA", "FADD", "FMUL", "FMNMX", "MUFU", "FSETP", "FSEL"),
    "convert": ("F2F", "F2FP", "I2F", "F2I", "HADD2", "HMUL2", "HFMA2"),
    "int/bit": ("IMAD", "IADD3", "LOP3", "SHF", "PRMT", "LEA", "ISETP", "SEL", "IABS", "IMNMX"),
    "shuffle": ("SHFL",),
}

KERNELS: list[tuple[str, tuple, object]] = []  # (name, grid, compiled kernel) of every launch the case made
# Values never matter for compiling, only shapes that reach constexprs: shrink what only sizes a pool, and
# skip the quantization of the indexer's 1M-key pools (minutes on a 2-core CPU; ~20 s without).
SMALLER = {"attention": {"PAGES_PER_SEQ": 4, "MIN_POOL_PAGES": 8}, "indexer": {"QUANTIZE": False}}


def _compile_instead_of_run(self, *args, grid, warmup, **kwargs):
    """Stand-in for JITFunction.run: specialize the arguments as Triton does, compile for sm_90a."""
    kwargs.setdefault("debug", False)
    backend = make_backend(TARGET)
    binder = jit.create_function_from_signature(self.signature, self.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET,
                              options=options.__dict__)
    KERNELS.append((self.__name__, grid, compiled))
    return compiled




def _ptxas(ptx: str, workdir: Path, name: str) -> dict:
    src = workdir / f"{name}.ptx"
    src.write_text(ptx)
    res = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(src), "-o", str(workdir / f"{name}.cubin")],
                         capture_output=True, text=True)
    text = res.stdout + res.stderr
    out = {}
    for key, pat in (("registers", r"Used (\d+) registers"), ("stack_bytes", r"(\d+) bytes stack frame"),
                     ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads")):
        m = re.search(pat, text)
        out[key] = int(m.group(1)) if m else None
    return out


def _sass_counts(cubin: bytes, workdir: Path, name: str, dump: Path | None) -> dict:
    path = workdir / f"{name}.sass.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True).stdout
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.sass").write_text(sass)
    ops = collections.Counter()
    widths = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)(\.[\w.]+)?", line)
        if not m:
            continue
        op, mods = m.group(1), m.group(2) or ""
        ops[op] += 1
        if op in ("LDG", "LDGSTS", "LDS", "STS", "STG"):
            w = re.search(r"\.(128|64|U8|S8|U16|S16)\b", mods)
            widths[f"{op}.{w.group(1) if w else '32'}"] += 1
    groups = {g: sum(ops[o] for o in names) for g, names in GROUPS.items()}
    groups["total"] = sum(ops.values())
    return dict(groups=groups, widths=dict(sorted(widths.items())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("case")
    ap.add_argument("--knobs", default="{}", help="JSON object of launcher keyword arguments")
    ap.add_argument("--dump", type=Path, help="write each kernel's SASS (and PTX) here")
    args = ap.parse_args(argv)
    try:
        knobs = json.loads(args.knobs)
    except json.JSONDecodeError as e:
        print(f"--knobs is not JSON: {e}", file=sys.stderr)
        return 2

    sys.path.insert(0, str(Path(__file__).parent))
    from dsv41.kernels.triton import common

    common.runnable = lambda t: True  # the launchers' "on CUDA?" check: we only compile
    common.CAPABILITY_OVERRIDE = (TARGET.arch // 10, TARGET.arch % 10)  # what the launchers plan for
    for mod in ("attention", "indexer", "mhc", "mhc_train", "cache_write"):
        m = importlib.import_module(f"dsv41.kernels.triton.{mod}")
        if hasattr(m, "runnable"):
            m.runnable = common.runnable
        if hasattr(m, "_sm_count"):
            m._sm_count = lambda index=0: 132
    module = importlib.import_module(f"kernel_cases.{args.family}")
    for name, value in SMALLER.get(args.family, {}).items():
        setattr(module, name, value)
    case = next((c for c in module.cases(torch.device("cpu")) if c["name"] == args.case), None)
    if case is None or "sweep" not in case:
        print(f"no sweepable case {args.case!r} in kernel_cases/{args.family}.py", file=sys.stderr)
        return 2
    jit.JITFunction.run = _compile_instead_of_run
    try:
        case["sweep"](**knobs)
    except Exception:
        if not KERNELS:
            raise
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i, (name, grid, compiled) in enumerate(KERNELS):
            tag = f"{i}_{name}"
            if args.dump is not None:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{tag}.ptx").write_text(compiled.asm["ptx"])
                (args.dump / f"{tag}.ttgir").write_text(compiled.asm["ttgir"])
            report = dict(kernel=name, grid=list(grid) if not callable(grid) else "callable",
                          warps=compiled.metadata.num_warps, shared_bytes=compiled.metadata.shared,
                          **_ptxas(compiled.asm["ptx"], work, tag),
                          **_sass_counts(compiled.asm["cubin"], work, tag, args.dump))
            print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
