"""Decodes split into several length groups give the same tokens as one batch of all decodes."""
from __future__ import annotations

import engine.runner.model_runner as model_runner
from checkpoints import random_prompt
from engine import LLM, SamplingParams

PROMPTS = [random_prompt(n, 5000 + n) for n in (3, 20, 40, 90, 150, 300, 520, 700)]


def _run(ckpt, monkeypatch, group: bool, calls: list[int]):
    monkeypatch.setattr(model_runner, "MIN_DECODE_GROUP", 1)
    llm = LLM(str(ckpt), dtype="float32", seed=0)
    llm.engine.runner.group_decodes = group
    orig = model_runner.ModelRunner._decode_groups

    def spy(self, batch, rows, tables, lens):
        groups = orig(self, batch, rows, tables, lens)
        calls.append(len(groups))
        if not group and groups:  # one group, longest first: the kernel's threads start on the longest rows
            assert groups[0].context_lens.tolist() == sorted(lens, reverse=True)
        return groups

    monkeypatch.setattr(model_runner.ModelRunner, "_decode_groups", spy)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    return [o.outputs[0].token_ids for o in outs], llm


def test_length_groups_match_single_group(ckpt_dir, monkeypatch):
    ckpt = ckpt_dir("llama")
    single_calls: list[int] = []
    single, _ = _run(ckpt, monkeypatch, False, single_calls)
    assert set(single_calls) <= {0, 1}
    grouped_calls: list[int] = []
    grouped, llm = _run(ckpt, monkeypatch, True, grouped_calls)
    assert max(grouped_calls) > 1, "the workload never produced more than one decode group"
    assert grouped == single
    llm.engine.check_integrity()


def test_runner_groups_only_for_padding_backends(ckpt_dir):
    llm = LLM(str(ckpt_dir("llama")), dtype="float32", seed=0)
    backend = llm.engine.runner.model.layers[0].self_attn.backend
    assert llm.engine.runner.group_decodes == type(backend).pads_decodes
