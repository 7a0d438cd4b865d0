"""Decodes split into several length groups give the same tokens as one padded batch."""
from __future__ import annotations

import pytest

import engine.model_runner as model_runner
from checkpoints import random_prompt
from engine import LLM, SamplingParams

PROMPTS = [random_prompt(n, 5000 + n) for n in (3, 20, 40, 90, 150, 300, 520, 700)]


def _run(ckpt, monkeypatch, min_group: int):
    monkeypatch.setattr(model_runner, "MIN_DECODE_GROUP", min_group)
    llm = LLM(str(ckpt), dtype="float32", seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_length_groups_match_single_group(ckpt_dir, monkeypatch):
    ckpt = ckpt_dir("llama")
    single, _ = _run(ckpt, monkeypatch, min_group=1000)  # everything in one padded group
    calls: list[int] = []
    orig = model_runner.ModelRunner._decode_groups

    def spy(self, rows, tables, lens):
        groups = orig(self, rows, tables, lens)
        calls.append(len(groups))
        return groups

    monkeypatch.setattr(model_runner.ModelRunner, "_decode_groups", spy)
    grouped, llm = _run(ckpt, monkeypatch, min_group=1)
    assert max(calls) > 1, "the workload never produced more than one decode group"
    assert grouped == single
    llm.engine.check_integrity()
