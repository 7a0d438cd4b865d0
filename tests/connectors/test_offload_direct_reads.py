"""G3 hits read straight into G1 (connectors/read_targets.py, issue 43).

Oracles: the codec's own views of an entry (where the bytes must land), loads through a buffer
and a copy (the path this replaces), and transformers' tokens. And the rule that makes it safe:
a read that outlives its timeout ends its load only once it has returned, because the load's
G1 blocks are its targets and the scheduler recomputes into them (or hands them back) as soon as
it hears of the load."""
from __future__ import annotations

import ctypes
import logging
import threading
import time

import numpy as np
import pytest
import torch

from connectors.codec import HEADER_BYTES, BlockLayout, hidden_payload, payload
from connectors.read_targets import G1Targets
from connectors.offload_plans import LoadDone
from kvstore.backend import Scatter
from kvstore.disk import DiskBackend
from offload_helpers import check_integrity, offload_llm, reference, run, tokens, workload

PROMPTS = workload()
G3_TIMEOUT_S = 0.2
HANG_S = 0.5  # past the timeout
TIMEOUT = {"kv_transfer_config": {"kv_connector_extra_config": {"g3_timeout_s": G3_TIMEOUT_S}}}


def _layout(**kw) -> BlockLayout:
    base = dict(num_layers=3, g1_blocks=4, block_size=2, kv_heads=2, head_dim=3, dtype=torch.float32,
                fingerprint="direct-reads", hidden_layer_ids=(1, 2), hidden_size=5)
    return BlockLayout(**{**base, **kw})


def _fill(s: Scatter, value: bytes) -> None:
    """What a read does: the value's bytes into the pieces, in order."""
    at = 0
    for a, n in zip(s.addresses.tolist(), s.lengths.tolist()):
        ctypes.memmove(a, value[at:at + n], n)
        at += n
    assert at == len(value)


@pytest.mark.parametrize("blocks", [[4, 5, 6, 7], [5, 6, 9, 2]], ids=["consecutive", "scattered"])
def test_an_entry_lands_where_the_copy_would_put_it(blocks) -> None:
    lay = _layout()
    kv = torch.zeros(lay.num_layers, 2, 12, lay.block_size, lay.kv_heads, lay.head_dim)
    hidden = torch.zeros(12, lay.block_size, 2, lay.hidden_size)
    assert G1Targets.usable(lay, kv, hidden)
    g1 = G1Targets(lay, kv, hidden)
    value = torch.randint(0, 256, (lay.encoded_bytes,), dtype=torch.uint8)
    value[HEADER_BYTES:].view(torch.float32).copy_(torch.randn(lay.payload_bytes // 4))  # no NaN patterns
    header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    _fill(g1.scatters([header], [blocks])[0], bytes(value.numpy()))
    idx = torch.tensor(blocks)
    assert header.tobytes() == bytes(value[:HEADER_BYTES].numpy())
    assert torch.equal(kv.index_select(2, idx), payload(value, lay))
    assert torch.equal(hidden.index_select(0, idx), hidden_payload(value, lay))
    others = [b for b in range(12) if b not in blocks]
    assert not kv[:, :, others].any() and not hidden[others].any()  # nothing else was touched
    assert g1.value(header, blocks) == bytes(value.numpy())  # and back, for a tier below


@pytest.mark.parametrize("placed", [[[0, 1, 2, 3], [8, 9, 10, 11], [4, 5, 6, 7]], [[5, 6, 9, 2], None, [0, 1, 3, 4]]],
                         ids=["runs", "scattered-and-bounced"])
def test_a_loads_batch_lands_each_entry_where_the_copy_would_put_it(placed) -> None:
    """A load's entries as one ScatterBatch (the usual one-run-each case in a few array operations,
    the rest through per-entry pieces): each value's bytes land in its blocks, or whole in its
    bounce buffer, and nowhere else."""
    lay = _layout()
    kv = torch.zeros(lay.num_layers, 2, 12, lay.block_size, lay.kv_heads, lay.head_dim)
    hidden = torch.zeros(12, lay.block_size, 2, lay.hidden_size)
    g1 = G1Targets(lay, kv, hidden)
    values = [torch.randint(0, 256, (lay.encoded_bytes,), dtype=torch.uint8) for _ in placed]
    for v in values:
        v[HEADER_BYTES:].view(torch.float32).copy_(torch.randn(lay.payload_bytes // 4))
    headers = np.zeros((len(placed), HEADER_BYTES), dtype=np.uint8)
    bounce = {j: torch.zeros(lay.encoded_bytes, dtype=torch.uint8) for j, b in enumerate(placed) if b is None}
    batch = g1.batch(headers, np.array([b if b is not None else [0] * 4 for b in placed]), bounce)
    assert len(batch) == len(placed)
    for j, v in enumerate(values):
        _fill(batch.scatter(j), bytes(v.numpy()))
    for j, (blocks, v) in enumerate(zip(placed, values)):
        if blocks is None:
            assert torch.equal(bounce[j], v)
            continue
        idx = torch.tensor(blocks)
        assert headers[j].tobytes() == bytes(v[:HEADER_BYTES].numpy())
        assert torch.equal(kv.index_select(2, idx), payload(v, lay))
        assert torch.equal(hidden.index_select(0, idx), hidden_payload(v, lay))
    others = [b for b in range(12) if all(b not in p for p in placed if p is not None)]
    assert not kv[:, :, others].any() and not hidden[others].any()


def test_g1_is_a_read_target_only_as_it_is() -> None:
    lay = _layout(hidden_layer_ids=(), hidden_size=0)
    kv = torch.zeros(lay.num_layers, 2, 12, lay.block_size, lay.kv_heads, lay.head_dim)
    assert G1Targets.usable(lay, kv, None)
    assert not G1Targets.usable(_layout(), kv, None)  # hidden states exported, but no cache for them
    assert not G1Targets.usable(_layout(dtype=torch.bfloat16, g1_dtype=torch.float32, hidden_layer_ids=()),
                                kv, None)  # --kv-offload-dtype: entries are converted on the way
    assert not G1Targets.usable(lay, kv.to(torch.bfloat16), None)
    assert not G1Targets.usable(lay, kv.transpose(0, 1), None)


@pytest.fixture(scope="module")
def filled(model_dir, tmp_path_factory):
    disk = tmp_path_factory.mktemp("direct") / "g3"
    llm = offload_llm(model_dir, kv_offload_disk=str(disk))
    try:
        run(llm, PROMPTS)
    finally:
        llm.close()
    return disk


@pytest.mark.parametrize("direct", [True, False], ids=["into-G1", "through-a-buffer"])
def test_g3_hits_read_into_g1_give_the_copys_tokens(model_dir, filled, monkeypatch, direct) -> None:
    if not direct:
        monkeypatch.setattr(DiskBackend, "scatter_reads", property(lambda self: False))
    llm = offload_llm(model_dir, kv_offload_disk=str(filled))
    try:
        assert llm.engine.connector.tier("G3").scatter_reads is direct
        outs = run(llm, PROMPTS)
        assert tokens(outs) == reference(model_dir, PROMPTS)
        assert all(o.cached_tokens_by_tier.get("G3", 0) > 0 for o in outs)
        tr = llm.engine.connector.transfer
        assert (tr.direct_blocks > 0, tr.copy_seconds > 0) == (direct, not direct)
        check_integrity(llm)
    finally:
        llm.close()


def test_a_late_read_into_g1_ends_its_load_only_once_it_returns(model_dir, filled, caplog) -> None:
    """The first reads hang past the timeout and then write garbage into their targets, as a read
    the kernel finishes late (and fails) would. Each load is reported only after that write: the
    garbage lands before the blocks are recomputed, so the tokens are the oracle's."""
    llm = offload_llm(model_dir, kv_offload_disk=str(filled), **TIMEOUT)
    g3 = llm.engine.connector.tier("G3").backend
    real, lock, writes, reported = g3.get_into_batch, threading.Lock(), [], []
    first = [True]

    def late_get_into_batch(keys, batch, threads):
        with lock:
            hang, first[0] = first[0], False
        if not hang:
            return real(keys, batch, threads)
        time.sleep(HANG_S)
        for a, n in zip(batch.addresses.tolist(), batch.lengths.tolist()):
            ctypes.memset(a, 0x7F, n)
        writes.append(time.perf_counter())
        return [False] * len(keys)

    tr = llm.engine.connector.transfer
    real_put = tr.reports.put

    def signal(item):
        if isinstance(item, LoadDone):
            reported.append(time.perf_counter())
        real_put(item)

    g3.get_into_batch, tr.reports.put = late_get_into_batch, signal
    caplog.set_level(logging.WARNING)
    try:
        outs = run(llm, PROMPTS[:1])
        assert writes and reported and min(reported) >= max(writes)
        assert tokens(outs) == reference(model_dir, PROMPTS[:1])
        assert any("outlived the timeout" in r.getMessage() for r in caplog.records)
        check_integrity(llm)
    finally:
        llm.close()
