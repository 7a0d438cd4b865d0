"""The sampler's batched greedy path against a per-row oracle: greedy rows without penalties are
picked in one call, every other row by its own settings, and the tokens must be what a row-by-row
argmax (first maximum on ties) and the per-row path give."""
from __future__ import annotations

import torch

from engine.core.request import Request, RequestId
from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams


def _req(i: int, **kw) -> Request:
    return Request(RequestId(str(i)), [1, 2, 3], SamplingParams(**kw), max_total_tokens=64)


def test_batched_greedy_matches_row_argmax_with_ties_and_mixed_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1.0  # a tie: the first index must win
    logits[2, 3] = 100.0  # penalised below; repetition_penalty shrinks token 3's logit
    reqs = [
        _req(0, temperature=0.0),
        _req(1, temperature=0.0),
        _req(2, temperature=0.0, repetition_penalty=1000.0),  # greedy, but not on the plain path
        _req(3, temperature=1.0, seed=5),
        _req(4, temperature=0.0, logprobs=2),
        _req(5, temperature=0.0),
    ]
    out = Sampler(seed=0)(logits.clone(), reqs)
    assert not out.errors
    plain = [0, 1, 4, 5]
    assert [out.token_ids[i] for i in plain] == [int(logits[i].argmax()) for i in plain]
    assert out.token_ids[1] == 7
    assert out.token_ids[2] != 3  # the penalty applied: token 3 (100 / 1000 = 0.1) lost
    # The random row is drawn from its own seeded stream, whatever else is in the batch.
    alone = Sampler(seed=0)(logits[3:4].clone(), [_req(3, temperature=1.0, seed=5)])
    assert out.token_ids[3] == alone.token_ids[0]
    assert set(out.logprobs[4]) >= {out.token_ids[4]}


def test_all_greedy_batch_equals_row_by_row():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1))
    reqs = [_req(i, temperature=0.0) for i in range(64)]
    assert Sampler(seed=0)(logits, reqs).token_ids == logits.argmax(dim=-1).tolist()
