#!/usr/bin/env python3
"""The CPU decode-attention kernel (engine/cpu_kernels/paged_attention.cpp) against the memory bound.

A batch of decode rows over random block tables (SmolLM's heads: 9 query, 3 kv, 64 wide; blocks of
16 unless --block-size says), in float32 and bfloat16, and over fp8 caches (e4m3, e5m2) under float32 q: the kernel's time per layer and the KV bytes it read per second,
beside a plain streaming read (torch's sum over a 512 MB tensor: what these cores pull from
memory), shown as the time it takes for the kernel's bytes, and the attention's arithmetic rate. `--layers 1` with a short context measures it on cached data
(its arithmetic alone).

`--prefill-rows N` times the prefill kernel (engine/cpu_kernels/prefill_attention.cpp) instead: one
sequence's last N rows over `--context` keys, the step after a prefix hit (N = 16 after a G1 hit
on a prompt of whole blocks), beside torch's SDPA over the same keys laid out contiguously (its
best case; float32 and bfloat16 caches only; `is_causal` when the rows are the whole context, its flash
kernel's fresh prefill). On a CPU with AMX or AVX512-BF16 the bfloat16 rows multiply in bf16 pairs (prefill_amx.h, prefill_bf16.h), and
"kvtier, AVX lanes" is the same call with them off. With `--prefill-rows 1` (the last prompt token after
a tier hit) the decode kernel over the same row is timed too: the runner sent that row there before
the prefill kernel's narrow path, and its bits differ from a fresh prefill's.

`--against FILE.cpp` builds FILE as a second library and alternates the two in this process, run
by run (the only way to see a 5% change on a shared machine): the table then has both, their
ratio, and whether their outputs are the same bits.

    .venv/bin/python benchmarks/kernels_cpu.py
    .venv/bin/python benchmarks/kernels_cpu.py --against /tmp/paged_attention_old.cpp
    .venv/bin/python benchmarks/kernels_cpu.py --prefill-rows 16 --context 4000 --against /tmp/prefill_attention_old.cpp

Writes benchmarks/results/kernels_cpu.json.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

import torch  # noqa: E402

from _common import RESULTS_DIR, machine_info, print_table, write_json  # noqa: E402
from engine import cpu_kernels  # noqa: E402
from engine.cpu_kernels import build  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
STREAM_BYTES = 512 << 20
# (q and out, cache): the model's dtype alike, and fp8 caches (--kv-cache-dtype) under float32 weights.
CASES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
         (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2))


def other_library(src: Path, workdir: Path, march: str) -> ctypes.CDLL:
    so = workdir / "other.so"
    subprocess.run([build._compiler(), *build._flags(march), "-I", str(Path(build.__file__).parent),
                    "-shared", str(src), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    ours = cpu_kernels.get()
    for fn in ("kvt_paged_attention", "kvt_prefill_attention"):
        if hasattr(lib, fn):  # a FILE.cpp defines one of them
            getattr(lib, fn).restype = getattr(ours, fn).restype
            getattr(lib, fn).argtypes = getattr(ours, fn).argtypes
    return lib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=None, help="decode rows (default 64; not with --prefill-rows)")
    ap.add_argument("--context", type=int, default=344, help="tokens per row (default %(default)s)")
    ap.add_argument("--layers", type=int, default=30, help="distinct layers' caches cycled through (default %(default)s)")
    ap.add_argument("--block-size", type=int, default=BLOCK, help="tokens per cache block (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating timed rounds; medians (default %(default)s)")
    ap.add_argument("--prefill-rows", type=int, default=0,
                    help="time the prefill kernel: one sequence's last N rows over --context keys (default: decodes)")
    ap.add_argument("--against", type=Path,
                    help="another paged_attention.cpp (prefill_attention.cpp with --prefill-rows) to alternate with this one")
    ap.add_argument("--march", default=build.MARCH,
                    help="build both libraries for this -march (haswell: the AVX2 path on an AVX-512 machine; "
                         "default %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "kernels_cpu.json")
    args = ap.parse_args()
    if args.batch is not None and args.prefill_rows:
        ap.error("--batch is for decodes; --prefill-rows times one sequence")
    args.batch = 64 if args.batch is None else args.batch
    if min(args.batch, args.context, args.layers, args.rounds, args.block_size) < 1:
        ap.error("--batch, --context, --layers, --rounds and --block-size must be >= 1")
    if not 0 <= args.prefill_rows <= args.context:
        ap.error("--prefill-rows must be between 0 and --context")
    prefill = args.prefill_rows > 0
    batch = 1 if prefill else args.batch
    try:
        ours = build.load(march=args.march)
    except build.BuildError as e:
        print(f"the CPU kernels did not build here: {e}", file=sys.stderr)
        return 2
    cpu_kernels._state["lib"] = ours
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-kernels-")
    libs = {"kvtier": ours}
    if args.against is not None:
        libs[args.against.name] = other_library(args.against, Path(tmp.name), args.march)
    nb = -(-args.context // args.block_size)
    rows, results = [], {}
    for dtype, cache_dtype in CASES:
        g = torch.Generator().manual_seed(0)
        kv = torch.randn(args.layers, 2, batch * nb + 1, args.block_size, KV_HEADS, HEAD_DIM, generator=g).to(cache_dtype)
        q = torch.randn(args.prefill_rows or batch, HEADS, HEAD_DIM, generator=g).to(dtype)
        idx, lens = torch.arange(batch), torch.full((batch,), args.context, dtype=torch.long)
        tables = torch.randperm(batch * nb, generator=g).view(batch, nb).contiguous()
        seqs = torch.tensor([[0, args.prefill_rows, args.context, 0]], dtype=torch.long)
        nbytes = batch * args.context * KV_HEADS * HEAD_DIM * 2 * kv.element_size()
        # QK^T and P.V over the keys each row sees (causal), 2 flops a multiply-add
        seen = sum(args.context - n_q + i + 1 for i in range(n_q)) if (n_q := args.prefill_rows) else batch * args.context
        flops = 4 * HEADS * HEAD_DIM * seen
        flat = torch.randn(STREAM_BYTES // 4)  # far past the last-level cache: what memory gives
        peers = ["stream read"]
        if prefill and cache_dtype == dtype:  # SDPA over the same keys, contiguous: [layers, 2, kv heads, context, D]
            dense = kv[:, :, tables[0]].flatten(2, 3)[:, :, :args.context].transpose(2, 3).contiguous()
            mask = torch.ones(args.prefill_rows, args.context, dtype=torch.bool).tril(args.context - args.prefill_rows)
            peers.insert(0, "torch SDPA")
        if args.prefill_rows == 1:
            peers.insert(0, "decode kernel")
        if prefill and dtype == cache_dtype == torch.bfloat16 and cpu_kernels.prefill_bf16_kind():
            peers.insert(0, "kvtier, AVX lanes")  # the same kernel with its bf16 pairs (AMX or vdpbf16ps) off
        times: dict[str, list[float]] = {name: [] for name in (*libs, *peers)}
        outs = {}
        reps = max(3, 150 // args.layers)

        def timed(name: str, call) -> None:
            """One round of `call(layer, out)` over every layer, reps times: seconds per layer."""
            out = torch.empty_like(q)
            t = time.perf_counter()
            for _ in range(reps):
                for layer in range(args.layers):
                    call(layer, out)
            times[name].append((time.perf_counter() - t) / reps / args.layers)
            outs[name] = out

        def prefill_call(pairs: bool = True):
            return lambda layer, out: cpu_kernels.prefill_attention(q, kv[layer, 0], kv[layer, 1], out, seqs,
                                                                    tables[0], 0.125, bf16_pairs=pairs)

        def decode_call(layer, out):
            cpu_kernels.paged_attention(q, kv[layer, 0], kv[layer, 1], out, idx, tables, lens, 0.125)

        for _ in range(args.rounds):
            for name, lib in libs.items():
                cpu_kernels._state["lib"] = lib
                timed(name, prefill_call() if prefill else decode_call)
            cpu_kernels._state["lib"] = ours
            if "kvtier, AVX lanes" in times:
                timed("kvtier, AVX lanes", prefill_call(pairs=False))
            if "decode kernel" in times:
                timed("decode kernel", decode_call)
            if "torch SDPA" in times:
                qt = q.transpose(0, 1)[None]
                t = time.perf_counter()
                for _ in range(reps):
                    for layer in range(args.layers):
                        torch.nn.functional.scaled_dot_product_attention(
                            qt, dense[layer, 0][None], dense[layer, 1][None], scale=0.125, enable_gqa=True,
                            **({"is_causal": True} if args.prefill_rows == args.context else {"attn_mask": mask}))
                times["torch SDPA"].append((time.perf_counter() - t) / reps / args.layers)
            t = time.perf_counter()
            flat.sum()
            times["stream read"].append((time.perf_counter() - t) * nbytes / STREAM_BYTES)  # as long as nbytes take
        cpu_kernels._state["lib"] = ours
        dt = str(cache_dtype).removeprefix("torch.") + ("" if cache_dtype == dtype else f" (q {str(dtype)[6:]})")
        for name, ts in times.items():
            med = statistics.median(ts)
            results[f"{name} {dt}"] = {"ms_per_layer": med * 1e3, "gb_s": nbytes / med / 1e9,
                                       "gflop_s": flops / med / 1e9}
            same = "" if name not in outs or name == "kvtier" else str(torch.equal(outs[name], outs["kvtier"]))
            ratio = f"{med / statistics.median(times['kvtier']):.3f}" if name != "stream read" else ""
            gflops = f"{flops / med / 1e9:.0f}" if name != "stream read" else ""
            rows.append([f"{name} {dt}", f"{med * 1e3:.3f}", f"{nbytes / med / 1e9:.1f}", gflops, ratio, same])
    m = machine_info()
    shape = f"{args.prefill_rows} prefill rows" if prefill else f"batch {args.batch}"
    print(f"{m['cpu_model']}, {m['cpu_isa']}, built for -march={args.march}; {shape}, context {args.context}, "
          f"blocks of {args.block_size}, "
          f"{args.layers} layers, {torch.get_num_threads()} threads")
    print_table(["kernel", "ms per layer", "GB/s", "GFLOP/s", "time / kvtier's", "same bits"], rows)
    write_json(args.out, {"benchmark": "kernels_cpu", "args": {k: str(v) for k, v in vars(args).items()},
                          "results": results})
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
