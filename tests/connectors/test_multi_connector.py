"""MultiConnector composes the tiered offload connector with a plugin connector."""
from __future__ import annotations

from checkpoints import random_prompt
from connectors.base import ConnectorMeta, FinishedTransfers, KVConnector
from engine import LLM, SamplingParams


class RecordingConnector(KVConnector):
    """A plugin loaded by kv_connector_module_path: never loads, records every finish."""

    instances: list["RecordingConnector"] = []

    def __init__(self, ctx) -> None:
        self.finished: list[str] = []
        self.scheduled_tokens = 0
        RecordingConnector.instances.append(self)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        assert num_external_tokens == 0

    def build_connector_meta(self, scheduled):
        self.scheduled_tokens += sum(n for _, n, _ in scheduled)
        return ConnectorMeta()

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return {"recorded_by": "RecordingConnector"}

    def get_finished(self):
        return FinishedTransfers()


def test_multi_connector_offloads_and_runs_plugins(ckpt_dir):
    prompts = [{"prompt_token_ids": random_prompt(n, 7000 + n)} for n in (200, 330)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = LLM(str(ckpt_dir("qwen3")), dtype="float32")
    want = [o.outputs[0].token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    tc = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": {"block_size": 32}},
        {"kv_connector": "RecordingConnector", "kv_connector_module_path": __name__},
    ]}}
    llm = LLM(str(ckpt_dir("qwen3")), dtype="float32", kv_offloading_size=0.02, kv_transfer_config=tc)
    first = llm.generate(prompts, sp, use_tqdm=False)
    tiers = llm.get_stats().tiers
    assert tiers["G2"]["miss_tokens"] == tiers["lookup_tokens"] == (192 + 320)  # nothing was offloaded yet
    llm.engine.flush_offload()
    llm.engine.pool.reset_prefix_cache()  # the second pass must come from G2
    second = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in second] == want
    assert all(o.cached_tokens_by_tier.get("G2", 0) >= 192 for o in second), [o.cached_tokens_by_tier for o in second]
    tiers = llm.get_stats().tiers
    assert tiers["G2"]["hit_tokens"] == 192 + 320 and tiers["G2"]["miss_tokens"] == 192 + 320
    rec = RecordingConnector.instances[-1]
    assert len(rec.finished) == 4 and rec.scheduled_tokens > 0
    assert all(o.kv_transfer_params == {"recorded_by": "RecordingConnector"} for o in first + second)
    llm.engine.connector.connectors[0].g2.check_integrity()
    llm.engine.pool.check_integrity()
    llm.close()
