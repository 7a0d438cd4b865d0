"""Device selection, the GPU dtype rule and G1 sizing (issue 14), checked on any machine: the
rules are pure functions; the CUDA profiling itself is exercised by `pytest -m gpu`."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, resolve_device
from engine.run_mode import CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB
from engine.model_config import resolve_dtype
from engine.core.gpu_memory import MemoryProfile, g1_budget_bytes
from engine.runner.model_runner import kv_cache_bytes_per_block

GIB = 2**30


def test_auto_follows_torch_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "CPU", "", "cuda:0:1"])
def test_unknown_device_is_refused(name):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_refused(name):
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device(name)


@pytest.mark.parametrize("ckpt,device,want", [
    (torch.float32, "cpu", torch.float32),
    ("float32", "cpu", torch.float32),
    (torch.bfloat16, "cpu", torch.bfloat16),
    ("float16", "cpu", torch.bfloat16),  # the CPU kernels take no float16
    (torch.float32, "cuda", torch.bfloat16),  # vLLM's rule: float32 checkpoints serve in bf16 on GPU
    (None, "cuda:1", torch.bfloat16),
    (torch.float16, "cuda", torch.float16),
    (torch.bfloat16, "cuda", torch.bfloat16),
])
def test_auto_dtype(ckpt, device, want):
    assert resolve_dtype("auto", ckpt, device, native_bf16=True) == want


@pytest.mark.parametrize("ckpt", [torch.bfloat16, "float16", torch.float32])
def test_auto_dtype_on_a_cpu_without_native_bf16_is_float32(ckpt, caplog):
    """AVX2 or AVX-512 without BF16: oneDNN would emulate bf16 through float32."""
    assert resolve_dtype("auto", ckpt, "cpu", native_bf16=False) == torch.float32
    assert not caplog.records
    assert resolve_dtype("bfloat16", ckpt, "cpu", native_bf16=False) == torch.bfloat16  # asked for: kept, with a warning
    assert any("emulates it through float32" in r.getMessage() for r in caplog.records), caplog.records
    caplog.clear()
    assert resolve_dtype("bfloat16", ckpt, "cpu", native_bf16=True) == torch.bfloat16
    assert not caplog.records


def test_auto_reads_the_cpu():
    from engine.runner.cpu_runtime import cpu_isa

    want = torch.bfloat16 if cpu_isa().native_bf16 else torch.float32
    assert resolve_dtype("auto", torch.bfloat16, "cpu") == want


def test_explicit_dtype_wins_on_gpu():
    assert resolve_dtype("float32", torch.float32, "cuda") == torch.float32


def test_config_resolves_auto_and_validates_utilization(tmp_path):
    assert EngineConfig(model=str(tmp_path)).device == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model=str(tmp_path), gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        EngineConfig(model=str(tmp_path), kv_cache_memory_gib=0)


def test_g1_budget_is_what_utilization_leaves():
    p = MemoryProfile(total=80 * GIB, in_use=17 * GIB, peak_activation=3 * GIB)
    assert g1_budget_bytes(p, 0.9) == int(80 * GIB * 0.9) - 20 * GIB
    assert g1_budget_bytes(p, 1.0) == 60 * GIB


def test_no_room_for_kv_names_the_knobs():
    p = MemoryProfile(total=24 * GIB, in_use=20 * GIB, peak_activation=2 * GIB)
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*--kv-cache-memory"):
        g1_budget_bytes(p, 0.9)
    with pytest.raises(ValueError, match="bad memory profile"):
        MemoryProfile(total=0, in_use=0, peak_activation=0)


def test_cpu_engine_sizes_g1_by_the_cpu_default(llama_ckpt, monkeypatch):
    from engine.llm import LLM

    monkeypatch.delenv(CPU_KV_CACHE_ENV, raising=False)

    llm = LLM(str(llama_ckpt), dtype="float32", device="cpu")
    try:
        mc = llm.engine.model_config
        per_block = kv_cache_bytes_per_block(mc, 16)
        assert llm.engine.pool.num_blocks == int(CPU_KV_CACHE_GIB * GIB // per_block)
    finally:
        llm.close()


def test_gpu_memory_utilization_on_cpu_is_said_aloud(llama_ckpt, caplog):
    from engine.llm import LLM

    with caplog.at_level("WARNING", logger="engine.core.engine_core"):
        LLM(str(llama_ckpt), dtype="float32", device="cpu", gpu_memory_utilization=0.5).close()
    assert "gpu_memory_utilization=0.5 does not apply on CPU" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine.core.engine_core"):
        LLM(str(llama_ckpt), dtype="float32", device="cpu").close()
    assert "gpu_memory_utilization" not in caplog.text


def test_the_cpu_default_follows_kvtier_cpu_kvcache_space(llama_ckpt, monkeypatch):
    """vLLM's VLLM_CPU_KVCACHE_SPACE, by kvtier's name: G1's default size in GiB on CPU."""
    from engine.llm import LLM

    monkeypatch.setenv(CPU_KV_CACHE_ENV, "0.125")
    with LLM(str(llama_ckpt), dtype="float32", device="cpu") as llm:
        per_block = kv_cache_bytes_per_block(llm.engine.model_config, 16)
        assert llm.engine.pool.num_blocks == int(0.125 * GIB // per_block)
    for bad in ("0", "-1", "lots", "inf", "nan"):
        monkeypatch.setenv(CPU_KV_CACHE_ENV, bad)
        with pytest.raises(ValueError, match=f"KVTIER_CPU_KVCACHE_SPACE must be a size in GiB > 0; got '{bad}'"):
            EngineConfig(model=str(llama_ckpt))
