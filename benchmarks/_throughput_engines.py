"""The engines `throughput.py` races, each driven the same way: `generate(workload)` times a batch
of greedy requests, `prefill(prompt)` times one long prompt to its first token. Stdlib only at
import time: the vLLM worker imports this in vLLM's own venv."""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import JsonWorker, Timer, log, vllm_cpu_env, worker_reply
from _proc_usage import tree_usage, usage_delta

MIN_TOKEN_ID = 100  # keep random prompts clear of special/control tokens
THROUGHPUT = Path(__file__).resolve().with_name("throughput.py")  # the vLLM worker's entry point


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]  # requested output tokens per request

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps([self.prompts, self.outputs]).encode()).hexdigest()[:16]


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(rng.randint(*prompt_range))])
        outputs.append(rng.randint(*output_range))
    return Workload(prompts, outputs)


def prefill_measurement(prompt: list[int], seconds: float, cached: int) -> dict[str, Any]:
    if cached:
        raise RuntimeError(f"the prefill hit {cached} cached tokens: it must be cold")
    return {"wall_s": seconds, "prompt_tok_s": len(prompt) / seconds}


def measurement(wl: Workload, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"wall_s": seconds, "output_tok_s": wl.output_tokens / seconds,
            "total_tok_s": (wl.output_tokens + wl.prompt_tokens) / seconds, **extra}


# -- engines -------------------------------------------------------------------------------------
class KvtierEngine:
    def __init__(self, model: str, dtype: str, seed: int, max_num_seqs: int, max_num_batched_tokens: int | None,
                 optimization_level: int | None = None):
        from engine import LLM

        self.llm = LLM(model, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, optimization_level=optimization_level)
        self.config = (f"-O{self.llm.config.optimization_level}, max_num_seqs={max_num_seqs}, "
                       f"max_num_batched_tokens={self.llm.engine.max_num_batched_tokens}")

    def generate(self, wl: Workload, salt: str, schema: dict | None = None) -> dict[str, Any]:
        """With `schema`, every request's output follows it (structured outputs): it ends where the
        JSON does (at most its length in the workload), and tok/s count the tokens produced."""
        from engine import SamplingParams

        before, used = self.llm.get_stats(), tree_usage(children=False)
        with Timer() as t:
            prompts = [{"prompt_token_ids": p} for p in wl.prompts]
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) if schema is None else
                      SamplingParams(temperature=0, max_tokens=n, structured_outputs={"json": schema})
                      for n in wl.outputs]
            outs = self.llm.generate(prompts, params, use_tqdm=False, cache_salt=salt)
        got = [len(o.outputs[0].token_ids) for o in outs]
        if schema is None and got != wl.outputs:
            raise RuntimeError(f"kvtier returned {sum(got)} output tokens, {wl.output_tokens} requested")
        after, used = self.llm.get_stats(), usage_delta(used, tree_usage(children=False))
        extra = {} if schema is None else {"output_tok_s": sum(got) / t.seconds, "output_tokens": sum(got),
                                           "total_tok_s": (sum(got) + wl.prompt_tokens) / t.seconds}
        return {**measurement(wl, t.seconds, cached_tokens=sum(o.num_cached_tokens for o in outs),
                              preemptions=after.num_preemptions - before.num_preemptions, usage=used,
                              thread_changes=after.cpu_thread_changes - before.cpu_thread_changes), **extra}

    def prefill(self, prompt: list[int], salt: str) -> dict[str, Any]:
        """One long prompt to its first token (a fresh salt: no prefix hits)."""
        from engine import SamplingParams

        used = tree_usage(children=False)
        with Timer() as t:
            out = self.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                                    use_tqdm=False, cache_salt=salt)[0]
        used = usage_delta(used, tree_usage(children=False))
        return {**prefill_measurement(prompt, t.seconds, out.num_cached_tokens), "usage": used}


class HFEngine:
    """One model shared by every batch size; `generate` takes the batch size."""

    def __init__(self, model: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").eval()
        gc = self.model.generation_config
        self.pad_id = gc.pad_token_id if gc.pad_token_id is not None else 0
        # No eos: rows run to max_new_tokens, like ignore_eos (a kwarg eos_token_id=None would be
        # overridden by the checkpoint's generation_config).
        gc.eos_token_id = None

    def generate(self, wl: Workload, batch_size: int, sort_by_output: bool) -> dict[str, Any]:
        torch = self.torch
        order = list(range(len(wl.outputs)))
        if sort_by_output:
            order.sort(key=lambda i: (wl.outputs[i], len(wl.prompts[i])))
        generated = 0
        with Timer() as t:
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                width = max(len(wl.prompts[i]) for i in idx)
                ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
                # The mask is always explicit: inferred from pad_token_id it would be wrong wherever a
                # prompt contains the pad id.
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):  # left padding: generated tokens follow every prompt directly
                    p = wl.prompts[i]
                    ids[row, width - len(p):] = torch.tensor(p)
                    mask[row, width - len(p):] = 1
                max_new = max(wl.outputs[i] for i in idx)
                with torch.inference_mode():
                    out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                              pad_token_id=self.pad_id)
                if out.shape[1] - width != max_new:
                    raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {max_new}")
                generated += len(idx) * max_new
        return measurement(wl, t.seconds, generated_tokens=generated)

    def prefill(self, prompt: list[int]) -> dict[str, Any]:
        torch = self.torch
        ids = torch.tensor([prompt])
        with Timer() as t, torch.inference_mode():
            self.model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
        return prefill_measurement(prompt, t.seconds, 0)


class VllmEngine:
    """Drives the worker below in the vLLM venv; vllm is never imported in this process."""

    def __init__(self, python: str, model: str, dtype: str, seed: int, threads: int, wl: Workload, warmup: int,
                 kv_gib: float, extra_env: list[str], workdir: Path, prefill: list[int] | None = None,
                 tensor_parallel_size: int = 1, lora: dict[str, Any] | None = None, pause_idle: bool = True):
        """`lora`: {"max_loras", "max_lora_rank", "adapters": [[name, folder], ...]}: request i runs
        under adapter i mod len(adapters) (benchmarks/lora.py). `pause_idle`: the worker is stopped
        (SIGSTOP) between its timed runs, so its idle wake-ups do not slow the other engines' runs."""
        spec = {"model": model, "dtype": dtype, "seed": seed, "warmup": warmup, "prompts": wl.prompts,
                "outputs": wl.outputs, "prefill": prefill, "tensor_parallel_size": tensor_parallel_size, "lora": lora}
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "spec.json").write_text(json.dumps(spec))
        self.worker = JsonWorker([python, str(THROUGHPUT), "--_vllm-worker", str(workdir / "spec.json")],
                                 vllm_cpu_env(threads, kv_gib, workdir, extra_env), workdir, name="vllm")
        self.config = ""
        self.pause_idle = pause_idle

    def wait_ready(self, timeout: float = 900) -> None:
        msg = self.worker.recv(timeout)  # start-up takes 1-2 min on 2 cores
        self.config = f"vllm {msg['vllm']}, kv {msg['kv_gib']} GiB, max_num_batched_tokens={msg.get('max_num_batched_tokens')}"
        log(f"vllm ready (load {msg['load_s']:.0f} s)")
        self._idle()

    def _idle(self) -> None:
        if self.pause_idle:  # so that it takes no time from the engine being timed
            self.worker.pause()

    def _ask(self, cmd: str) -> dict[str, Any]:
        self.worker.resume()
        try:
            self.worker.send(cmd)
            return self.worker.recv(timeout=3600)
        finally:
            self._idle()

    def generate(self, wl: Workload) -> dict[str, Any]:
        msg = self._ask("run")
        return measurement(wl, msg["wall_s"], cached_tokens=msg["cached_tokens"], usage=msg.get("usage", {}))

    def prefill(self, prompt: list[int]) -> dict[str, Any]:
        """The spec's prefill prompt (`prompt` is the same list, for the measurement)."""
        msg = self._ask("prefill")
        return {**prefill_measurement(prompt, msg["wall_s"], msg["cached_tokens"]), "usage": msg.get("usage", {})}

    def close(self) -> None:
        self.worker.close()


def vllm_worker(spec_path: str, reply_fd: int) -> None:
    """Runs under --vllm-python: load vLLM once, warm up, then time the workload on each 'run'."""
    send = worker_reply(reply_fd)
    try:
        import vllm
        from vllm import LLM, SamplingParams

        spec = json.loads(Path(spec_path).read_text())
        lora = spec.get("lora")
        t0 = time.perf_counter()
        extra = {} if lora is None else {"enable_lora": True, "max_loras": lora["max_loras"],
                                         "max_lora_rank": lora["max_lora_rank"]}
        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"],
                  tensor_parallel_size=spec.get("tensor_parallel_size", 1), **extra)
        loras = None
        if lora is not None:
            from vllm.lora.request import LoRARequest

            adapters = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(lora["adapters"])]
            loras = [adapters[i % len(adapters)] for i in range(len(spec["prompts"]))]
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for w in range(spec["warmup"]):
            n = 2 if loras is None else len(adapters)  # every adapter loaded before the timed runs
            llm.generate([{"prompt_token_ids": list(range(MIN_TOKEN_ID + 16 * w, MIN_TOKEN_ID + 16 * w + 16))}] * n,
                         warm, use_tqdm=False, lora_request=None if loras is None else adapters)
        sched = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
        send(vllm=vllm.__version__, load_s=time.perf_counter() - t0, kv_gib=os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
             max_num_batched_tokens=getattr(sched, "max_num_batched_tokens", None))
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        for cmd in sys.stdin:
            if cmd.strip() not in ("run", "prefill"):
                break
            llm.reset_prefix_cache()  # no hits on the previous run's blocks
            used = tree_usage()  # the worker and vLLM's engine-core process under it
            if cmd.strip() == "prefill":
                t = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": spec["prefill"]}], SamplingParams(temperature=0, max_tokens=1),
                                   use_tqdm=False)[0]
                send(wall_s=time.perf_counter() - t, cached_tokens=getattr(out, "num_cached_tokens", 0) or 0,
                     usage=usage_delta(used, tree_usage()))
                continue
            t = time.perf_counter()
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["outputs"]]
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            wall = time.perf_counter() - t
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != spec["outputs"]:
                raise RuntimeError(f"vLLM returned {sum(got)} output tokens, {sum(spec['outputs'])} requested")
            send(wall_s=wall, cached_tokens=sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs),
                 usage=usage_delta(used, tree_usage()))
    except BaseException as e:  # report, so the parent skips vLLM with a reason instead of hanging
        send(error=f"{type(e).__name__}: {e}")
        raise


