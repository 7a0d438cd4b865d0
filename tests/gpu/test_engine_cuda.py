"""The engine on a CUDA device (issue 14). Marked `gpu`: skipped without one; scripts/gpu-check.sh
runs them with `pytest -m gpu`. Oracles: transformers on the same GPU, and the engine itself with
offload off."""
from __future__ import annotations

import pytest
import torch

from checkpoints import hf_greedy, load_hf, random_prompt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def _exact_fp32():
    # TF32 matmuls would make float32 a 10-bit-mantissa format on both sides of the comparison.
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _greedy(llm, prompts, n=12):
    from engine.sampling_params import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_auto_picks_cuda_bf16_and_sizes_g1_from_utilization(llama_ckpt):
    from engine.llm import LLM

    llm = LLM(str(llama_ckpt), gpu_memory_utilization=0.3)
    try:
        core = llm.engine
        assert core.config.device == "cuda"
        assert core.model_config.dtype == torch.bfloat16  # the checkpoint is float32
        assert core.runner.kv_cache.is_cuda
        total = torch.cuda.get_device_properties(0).total_memory
        assert 0 < core.runner.kv_cache.numel() * core.runner.kv_cache.element_size() <= 0.3 * total
        assert all(len(t) == 12 for t in _greedy(llm, [random_prompt(40, 1), random_prompt(300, 2)]))
    finally:
        llm.close()


def test_greedy_tokens_match_transformers_on_the_gpu_in_float32(llama_ckpt):
    from engine.llm import LLM

    hf = load_hf(llama_ckpt).to("cuda")
    prompts = [random_prompt(n, seed) for seed, n in enumerate((5, 17, 130, 700))]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(str(llama_ckpt), dtype="float32", device="cuda", kv_cache_memory_gib=0.5)
    try:
        assert _greedy(llm, prompts) == want
    finally:
        llm.close()


@pytest.mark.parametrize("spans", ["one", "smallest"])
def test_offload_on_and_off_give_the_same_tokens(llama_ckpt, tmp_path, monkeypatch, spans):
    """`smallest`: G2 registered in the smallest page-aligned spans, so runs of slots a load
    copies at once may cross registrations (CUDA refuses such a copy: loads split at them; the
    splitting itself is checked on CPU in test_offload_identity)."""
    import kvstore.pinned
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    if spans == "smallest":
        monkeypatch.setattr(kvstore.pinned, "MAX_REGISTER_BYTES", 1)

    prompts = [random_prompt(n, 10 + n) for n in (64, 257, 1000)]
    plain = LLM(str(llama_ckpt), device="cuda", kv_cache_memory_gib=0.5)
    try:
        want = _greedy(plain, prompts)
    finally:
        plain.close()
    tiered = LLM(str(llama_ckpt), device="cuda", kv_cache_memory_gib=0.5, kv_offloading_size=0.5,
                 kv_offload_disk=str(tmp_path / "g3"), kv_offload_disk_size=1.0)
    try:
        assert _greedy(tiered, prompts) == want
        tiered.engine.flush_offload()
        tiered.engine.pool.reset_prefix_cache()
        outs = tiered.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.cached_tokens_by_tier.get("G2", 0) for o in outs) > 0  # the second pass loaded from G2
        assert tiered.get_stats().tiers["load_failures"] == 0
    finally:
        tiered.close()


def test_seeded_sampling_is_reproducible_on_the_gpu(llama_ckpt):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(str(llama_ckpt), device="cuda", kv_cache_memory_gib=0.5)
    try:
        sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
        a = llm.generate([{"prompt_token_ids": random_prompt(50, 3)}], sp, use_tqdm=False)[0].outputs[0].token_ids
        b = llm.generate([{"prompt_token_ids": random_prompt(50, 3)}], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert a == b and len(a) == 10
    finally:
        llm.close()


def test_unseeded_sampled_rows_are_drawn_on_the_device(llama_ckpt, monkeypatch):
    """engine/sample/batched.py on CUDA: unseeded sampled rows go through the device batch (none
    through the host's per-row path), and top-k holds."""
    import engine.sample.sampler as sampler_module
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    host_rows: list[int] = []
    real = sampler_module.Sampler._sample
    monkeypatch.setattr(sampler_module.Sampler, "_sample", lambda self, row, req: host_rows.append(1) or real(self, row, req))
    llm = LLM(str(llama_ckpt), dtype="float32", device="cuda", kv_cache_memory_gib=0.5)  # float32: no top ties
    try:
        sp = SamplingParams(temperature=0.8, top_k=1, max_tokens=8, ignore_eos=True)  # top-k 1: greedy's tokens
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [{"prompt_token_ids": random_prompt(40, s)} for s in range(6)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert got == want and host_rows == []
    finally:
        llm.close()


def test_g2_slab_is_page_locked_in_spans_and_released():
    import gc

    from kvstore.pinned import HostSlab, register_spans

    for _ in range(2):  # a second slab over reused pages must register again: the first unregistered
        # 3-page rows, spans of at most 100 kB: 8 rows (24 pages) a span, 8 spans.
        slab = HostSlab(64, 3 * 4096, pin=True, max_register_bytes=100_000)
        spans, t = slab.pinned_spans, slab.tensor
        assert len(spans) == 8 and all(ptr % 4096 == 0 for ptr, _ in spans)
        assert spans[0][0] == t.data_ptr() and sum(n for _, n in spans) == t.numel()
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))  # no gap, no page twice
        src = torch.arange(64 * 3 * 4096, dtype=torch.int64).remainder(251).to(torch.uint8).view(64, 3 * 4096)
        slab.tensor.copy_(src)
        # One async copy per span (a copy across two registrations is refused: "invalid argument").
        dev = torch.cat([slab.tensor[r:r + n].to("cuda", non_blocking=True)
                         for r, n in register_spans(64, 3 * 4096, 100_000)])
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), src)
        assert [slab.span_of(r) for r in range(64)] == [r // 8 for r in range(64)]
        del slab, dev
        gc.collect()


def test_copy_stream_waits_for_queued_work_and_finishes_before_leaving():
    from connectors.copy_stream import CopyStream

    dev = torch.device("cuda")
    copies = CopyStream(dev)
    x = torch.zeros(1 << 24, device=dev)
    torch.cuda._sleep(50_000_000)  # the default stream is busy for a while...
    x.fill_(7.0)  # ...before it writes what the copy must see (a forward writing a block)
    host = torch.empty(x.shape, pin_memory=True)
    with copies.scope():
        assert torch.cuda.current_stream(dev) != torch.cuda.default_stream(dev)
        host.copy_(x, non_blocking=True)
    assert bool((host == 7.0).all())  # ordered after fill_, complete when the scope ended
