"""The engine's step timing (EngineStats.busy_seconds / forward_seconds / bubble_fraction) against
a stopwatch around the model runner's `execute`, the forward it counts."""
from __future__ import annotations

import time

from checkpoints import random_prompt
from engine import LLM, SamplingParams


def test_forward_time_matches_a_stopwatch_and_the_bubble_is_the_rest(ckpt_dir):
    llm = LLM(str(ckpt_dir("llama")), dtype="float32", num_gpu_blocks=128)
    runner = llm.engine.runner
    real, timed = runner.execute, []

    def execute(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            timed.append(time.perf_counter() - t0)

    runner.execute = execute
    before = llm.get_stats()
    wall = time.perf_counter()
    llm.generate([{"prompt_token_ids": random_prompt(n, 7000 + n)} for n in (5, 40, 200)],
                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - wall
    st = llm.get_stats()
    forward = st.forward_seconds - before.forward_seconds
    busy = st.busy_seconds - before.busy_seconds
    assert len(timed) >= 12 and abs(forward - sum(timed)) < 0.002 + 0.05 * sum(timed), (forward, sum(timed))
    assert forward < busy <= wall
    assert 0 < st.bubble_fraction < 1
    assert abs(st.bubble_fraction - (1 - st.forward_seconds / st.busy_seconds)) < 1e-12
