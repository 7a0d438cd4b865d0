"""A step's linears on CPU: kvtier's own kernels (bfloat16 on AMX tiles, linear_amx.cpp; float32
on AVX2/AVX-512 panels, linear_f32.cpp; engine/cpu_kernels/) against oneDNN's packed GEMM (torch's
`mkldnn._linear_pointwise`, what kvtier ran before and what vLLM's CPU build runs through its own
handler) and a plain `torch.matmul`, with the weights streamed from memory as in a real step.

Every layer of the demo model (qkv, o, gate, up, down; `--layers` of them, each its own weights,
more than L3 holds by default) at each row count; alternated rounds in one process, medians. The
"bound" row is the weights' bytes at the rate a plain streaming read gets from these cores (torch's
sum over 512 MB): what a decode step's linears cannot beat. bfloat16 needs a CPU with AMX-BF16,
float32 one with AVX2 or AVX-512.

    .venv/bin/python benchmarks/linear_cpu.py --out docs/results/linear-amx-intel.json
    .venv/bin/python benchmarks/linear_cpu.py --dtype float32 --layers 30 --out docs/results/linear-f32.json

Writes benchmarks/results/linear_cpu.json by default.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # benchmarks/policies.py is not `policies`
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import machine_info, median, print_table, set_torch_threads, usable_cpus, write_json  # noqa: E402

# (out, in) of SmolLM2-135M's linears per layer: qkv, o, gate, up, down
SHAPES = ((960, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256,4096", help="comma-separated row counts (default %(default)s)")
    ap.add_argument("--layers", type=int, default=90, help="layers of distinct weights (default %(default)s: 640 MB)")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds per row count (default %(default)s)")
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads (default: usable CPUs)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="(default %(default)s)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "linear_cpu.json")
    args = ap.parse_args()
    import torch

    from engine.cpu_kernels import linear as own

    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16:
        ours, ready, pack, run = "kvtier AMX tiles", own.amx_ready, own.pack, own.linear
    else:
        ours, ready, pack, run = "kvtier f32 panels", own.f32_build, own.pack_f32, own.linear_f32
    if not ready():
        raise SystemExit(f"{ours}: not available on this CPU (or the CPU kernels are not built): nothing to measure")
    set_torch_threads(args.threads)
    torch.manual_seed(0)
    plain = [[torch.randn(o, i, dtype=dtype) * 0.05 for o, i in SHAPES] for _ in range(args.layers)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in plain]
    tiles = [[pack(w) for w in layer] for layer in plain]
    size = plain[0][0].element_size()
    nbytes = sum(o * i * size for o, i in SHAPES) * args.layers
    flops_per_row = nbytes * 2 // size  # 2 flops per weight
    stream = torch.ones((512 << 20) // size, dtype=dtype)
    stream.sum()
    t0 = time.perf_counter()
    stream.sum()
    read_gbs = stream.numel() * size / (time.perf_counter() - t0) / 1e9
    del stream

    results, table = [], []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(m, i, dtype=dtype) for i in {i for _, i in SHAPES}}
        for (o, i), w, p in zip(SHAPES, plain[0], tiles[0]):  # the kernels agree before they race
            torch.testing.assert_close(run(xs[i], p, None).float(), (xs[i] @ w.t()).float(), rtol=2e-2, atol=2e-2)
        fns = {
            ours: lambda: [run(xs[i], p, None) for layer in tiles for (_, i), p in zip(SHAPES, layer)],
            "oneDNN packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[i], p, None, "none", [], "")
                                      for layer in onednn for (_, i), p in zip(SHAPES, layer)],
            "plain matmul": lambda: [xs[i] @ w.t() for layer in plain for (_, i), w in zip(SHAPES, layer)],
        }
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = median(times["oneDNN packed"])
        for name, ts in times.items():
            s = median(ts)
            row = {"rows": m, "kernel": name, "ms_per_layer": s / args.layers * 1e3, "weights_gb_s": nbytes / s / 1e9,
                   "gflop_s": flops_per_row * m / s / 1e9, "speedup_vs_onednn": base / s}
            results.append(row)
            table.append([m, name, f"{row['ms_per_layer']:.3f}", f"{row['weights_gb_s']:.1f}", f"{row['gflop_s']:.0f}",
                          f"{row['speedup_vs_onednn']:.2f}"])
        table.append([m, "bound (stream read)", f"{nbytes / read_gbs / 1e9 / args.layers * 1e3:.3f}",
                      f"{read_gbs:.1f}", "", ""])
    info = machine_info()
    print(f"{info.get('cpu_model')}, {info.get('cpu_isa')}, {args.threads} threads; {args.layers} layers of "
          f"{nbytes / args.layers / 1e6:.1f} MB {args.dtype} weights; medians of {args.rounds} alternated rounds")
    print_table(["rows", "kernel", "ms per layer", "weights GB/s", "GFLOP/s", "x oneDNN"], table)
    payload = {"args": {**vars(args), "out": str(args.out)}, "stream_read_gb_s": read_gbs, "results": results}
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
