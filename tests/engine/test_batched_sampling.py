"""Unseeded sampled rows drawn as one batch on the logits' device (engine/sample/batched.py), run
here on CPU: the batch's filter is the host's per-row rule (`_filtered_probs`) row for row, its
draws follow each row's distribution, and only the rows it may take go there."""
from __future__ import annotations

import torch

from engine.core.request import Request, RequestId
from engine.sample.batched import filtered_probs
from engine.sample.sampler import Sampler, _filtered_probs, sampling_distribution
from engine.sampling_params import SamplingParams

SETTINGS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.2), (0.5, 3, 0.5, 0.1),
    (1.0, 0, 1e-46, 0.0), (2.0, 64, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1e-4, 0, 0.95, 0.0), (1.0, 10, 0.8, 0.05),
]


def _req(i: int, **kw) -> Request:
    return Request(RequestId(str(i)), [1, 2, 3], SamplingParams(**kw), max_total_tokens=64)


def test_the_batch_filter_is_the_host_rule_row_for_row() -> None:
    g = torch.Generator().manual_seed(0)
    n, vocab = len(SETTINGS) + 2, 64
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[-2, 5] = float("inf")  # degenerate rows: drawn as their argmax on both paths
    logits[-1, :] = float("-inf")
    settings = SETTINGS + [(1.0, 0, 1.0, 0.0)] * 2
    t, k, p, m = (torch.tensor(c) for c in zip(*settings))
    probs, degenerate = filtered_probs(logits, t.float(), k.long(), p.float(), m.float())
    for i, (temp, top_k, top_p, min_p) in enumerate(settings):
        host = _filtered_probs(logits[i] / temp, top_k, top_p, min_p)
        assert bool(degenerate[i]) == (host is None), i
        if host is not None:
            torch.testing.assert_close(probs[i], host, rtol=0, atol=1e-7, msg=f"row {i}: {settings[i]}")


def test_batched_draws_follow_each_rows_distribution() -> None:
    vocab, draws = 8, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 0.3, 1.5], [0.0] * 8, [3.0, 2.9, 0.0, 0, 0, 0, 0, 0]])
    params = [dict(temperature=1.0), dict(temperature=1.0, top_k=3), dict(temperature=0.8, top_p=0.9)]
    reqs = [_req(i, **kw) for i, kw in enumerate(params)]
    sampler = Sampler(seed=0, batch_on_device=True)
    counts = torch.zeros(len(reqs), vocab)
    for _ in range(draws):
        out = sampler(logits, reqs)
        assert not out.errors
        counts[torch.arange(len(reqs)), torch.tensor(out.token_ids)] += 1
    for i, req in enumerate(reqs):
        want = sampling_distribution(logits[i:i + 1], req)[0].float()
        # 4 standard errors of a frequency at 6000 draws is under 0.026
        assert (counts[i] / draws - want).abs().max() < 0.026, (i, counts[i] / draws, want)
        assert bool((counts[i][want == 0] == 0).all()), f"row {i} drew a token its filter removed"


def test_only_unseeded_plain_rows_take_the_batch(monkeypatch) -> None:
    import engine.sample.sampler as sampler_module

    taken: list[list[str]] = []
    real = sampler_module.sample_rows
    monkeypatch.setattr(sampler_module, "sample_rows",
                        lambda lg, rs, gen: taken.append([r.request_id for r in rs]) or real(lg, rs, gen))
    reqs = [_req(0, temperature=1.0), _req(1, temperature=1.0, seed=3), _req(2, temperature=0.0),
            _req(3, temperature=0.9, top_k=4, presence_penalty=0.5), _req(4, temperature=0.9, top_p=0.5)]
    logits = torch.randn(len(reqs), 40, generator=torch.Generator().manual_seed(2))
    out = Sampler(seed=0, batch_on_device=True)(logits, reqs)
    assert not out.errors and taken == [["0", "4"]]
    # A seeded row draws what it draws alone on the host path, whatever else is in the batch.
    alone = Sampler(seed=0, batch_on_device=False)(logits[1:2], [_req(1, temperature=1.0, seed=3)])
    assert out.token_ids[1] == alone.token_ids[0]
    assert out.token_ids[2] == int(logits[2].argmax())
    # Off by default where the logits are on the CPU: CPU runs keep their token streams.
    taken.clear()
    Sampler(seed=0)(logits, reqs)
    assert taken == []
