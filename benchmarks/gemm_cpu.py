"""kvtier's CPU linears against vLLM's, kernel to kernel: torch's `mkldnn._linear_pointwise` on
oneDNN-prepacked weights (engine/models/packed_linear.py) and vLLM's own oneDNN handler
(`create_onednn_mm` / `onednn_mm`, what vLLM's CPU build runs for unquantized linears), and a
plain `torch.matmul` on the unpacked weight (oneDNN's matmul primitive), at every linear shape of
the demo model and a range of row counts, in float32 or bfloat16 (`--dtype`; on AMX, bfloat16 is
issue 39's acceptance 2: the packed GEMMs against a plain matmul of the same shapes). Alternated
rounds in one process, medians reported. Runs under vLLM's python (it imports vllm):

    /tmp/vllmvenv/bin/python benchmarks/gemm_cpu.py --out docs/results/gemm.json
    /tmp/vllmvenv/bin/python benchmarks/gemm_cpu.py --dtype bfloat16 --rows 16,256,2048,4096

`ONEDNN_VERBOSE=1` shows which oneDNN kernel each runs (docs/CPU.md).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# (in, out) features of SmolLM2-135M's linears: qkv, o, gate or up, gate+up, down, lm_head
SHAPES = ((576, 960), (576, 576), (576, 1536), (576, 3072), (1536, 576), (576, 49152))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256,2048", help="comma-separated row counts (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds per case; median (default %(default)s)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="(default %(default)s)")
    ap.add_argument("--out", type=Path, help="JSON results")
    args = ap.parse_args()
    import torch
    from vllm import _custom_ops as ops

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    rows = [int(m) for m in args.rows.split(",")]
    results = []
    print(f"{args.dtype}, {args.threads} threads; GFLOP/s, medians of {args.rounds} alternated rounds")
    print(f"{'in':>5} {'out':>6} {'rows':>5}  {'vllm':>7}  {'packed':>7}  {'matmul':>7}  packed/vllm  packed/matmul")
    for k, n in SHAPES:
        w = torch.randn(n, k).to(dtype)
        handler = ops.create_onednn_mm(w.t(), 32)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            fns = {"vllm": lambda: ops.onednn_mm(handler, x, None),
                   "torch": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                   "matmul": lambda: torch.matmul(x, w.t())}
            for other in ("vllm", "matmul"):
                if not torch.allclose(fns[other]().float(), fns["torch"]().float(), atol=tol, rtol=tol):
                    raise SystemExit(f"{other} and the packed GEMM differ at {m}x{k}x{n}")
            flops = 2 * m * n * k
            reps = min(2000, max(3, int(2e9 / flops)))
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    times[name].append((time.perf_counter() - t0) / reps)
            med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
            row = {"in": k, "out": n, "rows": m, "vllm_gflops": flops / med["vllm"] / 1e9,
                   "torch_gflops": flops / med["torch"] / 1e9, "matmul_gflops": flops / med["matmul"] / 1e9,
                   "torch_over_vllm": med["vllm"] / med["torch"], "torch_over_matmul": med["matmul"] / med["torch"]}
            results.append(row)
            print(f"{k:5d} {n:6d} {m:5d}  {row['vllm_gflops']:7.0f}  {row['torch_gflops']:7.0f}  "
                  f"{row['matmul_gflops']:7.0f}  {row['torch_over_vllm']:11.2f}  {row['torch_over_matmul']:13.2f}",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps({"dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
                                         "results": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
