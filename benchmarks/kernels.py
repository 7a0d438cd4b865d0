#!/usr/bin/env python3
"""Times the Triton kernels (engine/kernels) against torch at realistic sizes, bf16, block size 16.

- decode: batch 64 at 2k and 16k contexts, Llama-8B heads (32q/8kv x 128) and SmolLM heads
  (9q/3kv x 64), bf16 and fp8 (e4m3) caches, vs the engine's torch backend (gather + masked SDPA) and vs SDPA (flash) on
  dense contiguous K/V; achieved bandwidth = K/V bytes read / time, vs the measured
  device-to-device copy bandwidth.
- prefill: a 2048-token chunk after 8k cached tokens (vs the engine's torch backend and SDPA
  with a lower-right causal mask on dense K/V), and a fresh 8k prompt (vs SDPA flash, causal).
- kv_write: 64 and 2048 tokens vs index_copy_; gather/scatter of 256 blocks of a Llama-8B-shaped
  full cache (32 layers) vs index_select / index_copy_, and vs the copy bandwidth.

Needs CUDA (`triton.testing.do_bench`, median). `--smoke` runs tiny shapes anywhere, the
interpreter included, to check the script itself. Writes benchmarks/results/kernels-*.json.
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import RESULTS_DIR, log, print_table, write_json  # noqa: E402
from engine import kernels as K  # noqa: E402
from engine.runner.attention import AttentionMetadata, DecodeGroup, PrefillSeq, TorchPagedAttention  # noqa: E402

BS = 16
HEADS = {"llama8b": (32, 8, 128), "smollm": (9, 3, 64)}


def bench(fn: Callable[[], Any], cuda: bool) -> float:
    """Median microseconds of `fn`."""
    if cuda:
        import triton.testing

        return 1000 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    t = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - t)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuda: bool, **kw: Any) -> tuple[Callable[[], Any], str]:
    """SDPA on `[B, H, L, D]` tensors, flash backend on CUDA when it takes the call (else default)."""
    gqa = q.shape[1] != k.shape[1]
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)
        try:
            flash()
            return flash, "flash"
        except RuntimeError as exc:
            log(f"  SDPA flash refused ({str(exc).splitlines()[0][:80]}); default backend")
    return (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)), "default"


def paged_cache(batch: int, ctx: int, kv_heads: int, dim: int, dev: torch.device,
                kv_dtype: torch.dtype = torch.bfloat16):
    """Random K/V for `batch` sequences of `ctx` tokens at shuffled (non-contiguous) blocks."""
    nb = math.ceil(ctx / BS)
    kc = torch.randn(batch * nb + 1, BS, kv_heads, dim, device=dev).to(kv_dtype)
    vc = torch.randn(kc.shape, device=dev).to(kv_dtype)
    tables = (torch.randperm(batch * nb, device=dev) + 1).view(batch, nb)
    return kc, vc, tables


def decode_case(name: str, batch: int, ctx: int, dev: torch.device, cuda: bool, copy_gbs: float | None,
                kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """bf16 q over a `kv_dtype` cache (fp8: --kv-cache-dtype fp8, read in place; the dense SDPA
    baseline gets the same values in bf16); bandwidth counts the cache's own bytes."""
    hq, hkv, dim = HEADS[name]
    fp8 = kv_dtype != torch.bfloat16
    log(f"decode {name} B={batch} ctx={ctx}{' fp8' if fp8 else ''}")
    kc, vc, tables = paged_cache(batch, ctx, hkv, dim, dev, kv_dtype)
    q = torch.randn(batch, hq, dim, device=dev, dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    scale = dim ** -0.5
    tri = bench(lambda: K.paged_decode(q, kc, vc, tables, lens, scale, max_seq_len=ctx), cuda)
    # The engine's torch backend: one padded decode group (gather, then masked SDPA).
    backend = TorchPagedAttention()
    mask = (torch.arange(tables.shape[1] * BS, device=dev) < ctx).expand(batch, 1, 1, -1)
    meta = AttentionMetadata(tables[:, -1] * BS, [], [DecodeGroup(torch.arange(batch, device=dev), tables, lens.long(), mask)])
    kv = torch.randn(batch, hkv, dim, device=dev, dtype=torch.bfloat16)
    eng = bench(lambda: backend.forward(q, kv, kv, kc, vc, meta, scale), cuda)
    # Ideal unpaged baseline: dense K/V, contiguous per sequence.
    kd = kc.to(torch.bfloat16)[tables.flatten()].view(batch, -1, hkv, dim)[:, :ctx].transpose(1, 2).contiguous()
    vd = vc.to(torch.bfloat16)[tables.flatten()].view(batch, -1, hkv, dim)[:, :ctx].transpose(1, 2).contiguous()
    fn, backend_name = sdpa(q.unsqueeze(2), kd, vd, cuda, scale=scale)
    dense = bench(fn, cuda)
    err = (K.paged_decode(q, kc, vc, tables, lens, scale).float() - fn().squeeze(2).float()).abs().max().item()
    gbs = 2 * batch * ctx * hkv * dim * kc.element_size() / (tri * 1e-6) / 1e9
    case = f"{name} B={batch} ctx={ctx}{' ' + str(kv_dtype)[6:] if fp8 else ''}"
    return {"kernel": "decode", "case": case, "triton_us": tri, "torch_us": eng,
            "sdpa_us": dense, "sdpa": backend_name, "max_abs_err": err, "achieved": f"{gbs:.0f} GB/s",
            "pct_copy_bw": 100 * gbs / copy_gbs if copy_gbs else None}


def prefill_case(name: str, q_len: int, ctx: int, dev: torch.device, cuda: bool) -> dict:
    """One sequence: `q_len` query rows at the end of `ctx` cached tokens (q_len == ctx: a fresh prompt)."""
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv, dim = HEADS[name]
    scale = dim ** -0.5
    log(f"prefill {name} q={q_len} ctx={ctx}")
    kc, vc, tables = paged_cache(1, ctx, hkv, dim, dev)
    q = torch.randn(q_len, hq, dim, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    tri = bench(lambda: K.paged_prefill(q, kc, vc, tables, cu, lens, scale, max_query_len=q_len), cuda)
    kd = kc[tables[0]].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
    vd = vc[tables[0]].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
    qd = q.transpose(0, 1).unsqueeze(0)
    eng = None
    if q_len != ctx:
        # SDPA's is_causal is top-left aligned: a chunk after cached tokens needs lower-right.
        kr, vr = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
        bias = causal_lower_right(q_len, ctx)
        fn = lambda: F.scaled_dot_product_attention(qd, kr, vr, attn_mask=bias, scale=scale)  # noqa: E731
        backend_name = "lower-right bias"
        backend = TorchPagedAttention()
        meta = AttentionMetadata(torch.arange(q_len, device=dev), [PrefillSeq(0, q_len, ctx, tables[0])], [])
        kv = torch.randn(q_len, hkv, dim, device=dev, dtype=torch.bfloat16)
        kc2, vc2 = kc.clone(), vc.clone()  # the backend writes k/v: keep the timed cache intact
        eng = bench(lambda: backend.forward(q, kv, kv, kc2, vc2, meta, scale), cuda)
    else:
        fn, backend_name = sdpa(qd, kd, vd, cuda, scale=scale, is_causal=True)
    dense = bench(fn, cuda)
    got = K.paged_prefill(q, kc, vc, tables, cu, lens, scale, max_query_len=q_len)
    err = (got.float() - fn()[0].transpose(0, 1).float()).abs().max().item()
    keys = sum(ctx - q_len + i + 1 for i in range(q_len))  # causal: row i sees ctx - q_len + i + 1 keys
    tflops = 4 * hq * dim * keys / (tri * 1e-6) / 1e12
    return {"kernel": "prefill", "case": f"{name} q={q_len} ctx={ctx}", "triton_us": tri, "torch_us": eng,
            "sdpa_us": dense, "sdpa": backend_name, "max_abs_err": err, "achieved": f"{tflops:.0f} TFLOP/s"}


def kv_write_case(tokens: int, num_blocks: int, dev: torch.device, cuda: bool) -> dict:
    _, hkv, dim = HEADS["llama8b"]
    log(f"kv_write T={tokens}")
    kc = torch.randn(num_blocks, BS, hkv, dim, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    k = torch.randn(tokens, hkv, dim, device=dev, dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * BS, device=dev)[:tokens]
    tri = bench(lambda: K.kv_write(k, k, kc, vc, slots), cuda)
    # What the engine's torch backend does (kv_write_ref also drops padding slots, which syncs).
    kf, vf = kc.view(-1, hkv, dim), vc.view(-1, hkv, dim)
    ref = bench(lambda: (kf.index_copy_(0, slots, k), vf.index_copy_(0, slots, k)), cuda)
    return {"kernel": "kv_write", "case": f"llama8b T={tokens}", "triton_us": tri, "torch_us": ref,
            "torch": "index_copy_ x2"}


def block_copy_rows(layers: int, num_blocks: int, nsel: int, dev: torch.device, cuda: bool,
                    copy_gbs: float | None) -> list[dict]:
    """Gather then scatter `nsel` blocks of a Llama-8B-shaped full cache `[layers, 2, num_blocks, ...]`."""
    _, hkv, dim = HEADS["llama8b"]
    cache = torch.randn(layers, 2, num_blocks, BS, hkv, dim, device=dev, dtype=torch.bfloat16)
    ids = torch.randperm(num_blocks, device=dev)[:nsel]
    stage = torch.empty(layers, 2, nsel, BS, hkv, dim, device=dev, dtype=torch.bfloat16)
    moved = 2 * stage.numel() * stage.element_size()  # bytes read + written
    cases = {
        "gather": (lambda: K.gather_blocks(cache, ids, out=stage), lambda: torch.index_select(cache, 2, ids, out=stage),
                   "index_select"),
        "scatter": (lambda: K.scatter_blocks(stage, ids, cache), lambda: cache.index_copy_(2, ids, stage),
                    "index_copy_"),
    }
    rows = []
    for name, (fn, ref, ref_name) in cases.items():
        log(f"{name} {nsel} blocks")
        tri, t_ref = bench(fn, cuda), bench(ref, cuda)
        gbs = moved / (tri * 1e-6) / 1e9
        rows.append({"kernel": name, "case": f"{nsel} blocks x {layers} layers ({stage.nbytes >> 20} MiB)",
                     "triton_us": tri, "torch_us": t_ref, "torch": ref_name, "achieved": f"{gbs:.0f} GB/s",
                     "pct_copy_bw": 100 * gbs / copy_gbs if copy_gbs else None})
    return rows


def copy_bandwidth(dev: torch.device, cuda: bool, mib: int) -> float | None:
    """Device-to-device copy_ bandwidth (bytes read + written per second), GB/s."""
    if not cuda:
        return None
    src = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src), cuda)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device (checks the script)")
    ap.add_argument("--copy-to", type=Path, help="also write the JSON into this directory")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not K.available() or (not cuda and not args.smoke):
        sys.exit(f"benchmarks/kernels.py needs CUDA (or --smoke): {K.unavailable_reason() or 'no CUDA device'}")
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth(dev, cuda, 64 if args.smoke else 1024)
    log(f"device-to-device copy: {copy_gbs or 0:.0f} GB/s")
    if args.smoke:
        decodes, (cached, chunk, fresh), copies = [(2, 40)], (24, 16, 32), (2, 8, 3, [5])
    else:  # batch/context, prefill cached/chunk/fresh, layers/blocks/blocks copied/tokens written
        decodes, (cached, chunk, fresh) = [(64, 2048), (64, 16384)], (8192, 2048, 8192)
        copies = (32, 2048, 256, [64, 2048])
    rows = [decode_case(name, b, ctx, dev, cuda, copy_gbs, kv) for name in HEADS for b, ctx in decodes
            for kv in (torch.bfloat16, torch.float8_e4m3fn)]  # fp8: issue 44's >= 70% of copy bandwidth
    rows += [prefill_case(name, q_len, ctx, dev, cuda) for name in HEADS
             for q_len, ctx in ((chunk, cached + chunk), (fresh, fresh))]
    layers, num_blocks, nsel, tokens = copies
    rows += [kv_write_case(n, num_blocks, dev, cuda) for n in tokens]
    rows += block_copy_rows(layers, num_blocks, nsel, dev, cuda, copy_gbs)
    for r in rows:
        r["vs_torch"] = f"{r['torch_us'] / r['triton_us']:.2f}x" if r.get("torch_us") else None
        r["vs_sdpa"] = f"{r['sdpa_us'] / r['triton_us']:.2f}x" if r.get("sdpa_us") else None
    device_name = torch.cuda.get_device_name(dev) if cuda else "cpu (TRITON_INTERPRET)"
    print(f"{device_name}, torch {torch.__version__}, triton {K._triton.triton.__version__}, "
          f"device-to-device copy {copy_gbs or 0:.0f} GB/s (read + write)")
    cols = ["kernel", "case", "triton_us", "torch_us", "vs_torch", "sdpa_us", "vs_sdpa", "achieved", "pct_copy_bw"]
    print_table(["kernel", "case", "triton us", "torch us", "vs torch", "SDPA us", "vs SDPA", "achieved", "% copy bw"],
                [[r.get(c) for c in cols] for r in rows])
    tag = "smoke" if args.smoke else ("h100" if "H100" in device_name else "gpu")
    path = write_json(RESULTS_DIR / f"kernels-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.json", {
        "device": device_name, "triton": K._triton.triton.__version__, "copy_gbs": copy_gbs, "block_size": BS,
        "dtype": "bfloat16", "rows": rows,
    })
    log(f"wrote {path}")
    if args.copy_to:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.copy_to / path.name)


if __name__ == "__main__":
    main()
