"""Sampled and penalised rows processed as one batch on the logits' device
(engine/sample/batched.py), run here on CPU: the batch's filter and penalties are the host's per-row
rules (`_filtered_probs`, `_apply_penalties`) row for row, greedy rows with penalties give the host
path's tokens, draws follow each row's distribution, and only the rows it may take go there."""
from __future__ import annotations

import torch

from engine.core.request import Request, RequestId
from engine.sample.batched import filtered_probs, penalised
from engine.sample.sampler import Sampler, _apply_penalties, _filtered_probs, sampling_distribution
from engine.sampling_params import SamplingParams

SETTINGS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.2), (0.5, 3, 0.5, 0.1),
    (1.0, 0, 1e-46, 0.0), (2.0, 64, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1e-4, 0, 0.95, 0.0), (1.0, 10, 0.8, 0.05),
]


def _req(i: int, outputs: tuple[int, ...] = (), prompt: tuple[int, ...] = (1, 2, 3), bad: tuple = (), grammar=None,
         **kw) -> Request:
    """A request with `outputs` sampled so far; `bad`: its bad words as token sequences."""
    from engine.sample.logit_controls import BadWords

    r = Request(RequestId(str(i)), list(prompt), SamplingParams(**kw), max_total_tokens=64, bad_word_ids=BadWords(bad),
                grammar=grammar)
    for t in outputs:
        r.append_token(t)
    return r


def test_the_batch_filter_is_the_host_rule_row_for_row() -> None:
    g = torch.Generator().manual_seed(0)
    n, vocab = len(SETTINGS) + 2, 64
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[-2, 5] = float("inf")  # degenerate rows: drawn as their argmax on both paths
    logits[-1, :] = float("-inf")
    settings = SETTINGS + [(1.0, 0, 1.0, 0.0)] * 2
    t, k, p, m = (torch.tensor(c) for c in zip(*settings))
    probs, degenerate, fallback = filtered_probs(logits, t.float(), k.long(), p.float(), m.float())
    for i, (temp, top_k, top_p, min_p) in enumerate(settings):
        host = _filtered_probs(logits[i] / temp, top_k, top_p, min_p)
        assert bool(degenerate[i]) == (host is None), i
        if host is None:
            assert int(fallback[i]) == int((logits[i] / temp).argmax()), i
        else:
            torch.testing.assert_close(probs[i], host, rtol=0, atol=1e-7, msg=f"row {i}: {settings[i]}")


PENALTIES = [  # (sampling params, outputs so far)
    (dict(repetition_penalty=1.3), (7, 9, 7)),
    (dict(presence_penalty=0.7), (5, 5, 11, 2)),
    (dict(frequency_penalty=0.4), (5, 5, 5, 11)),
    (dict(presence_penalty=-0.5, frequency_penalty=0.25, repetition_penalty=0.8), (3, 3, 40)),
    (dict(min_tokens=5, stop_token_ids=[4, 8]), (1,)),
    (dict(min_tokens=1, stop_token_ids=[4]), (1, 2)),  # past min_tokens: nothing suppressed
    (dict(), ()),
    (dict(frequency_penalty=1.0), ()),  # no outputs yet: nothing to count
]


def test_batch_penalties_are_the_host_rule_row_for_row() -> None:
    logits = torch.randn(len(PENALTIES), 48, generator=torch.Generator().manual_seed(3)) * 4
    reqs = [_req(i, outs, prompt=(3, 6, 9, 12), temperature=0.0, **kw) for i, (kw, outs) in enumerate(PENALTIES)]
    got = penalised(logits, reqs)
    assert torch.equal(logits, logits.clone()) and not torch.equal(got, logits)
    for i, r in enumerate(reqs):
        assert torch.equal(got[i], _apply_penalties(logits[i].clone(), r)), (i, PENALTIES[i])


def test_greedy_rows_with_penalties_give_the_host_paths_tokens() -> None:
    g = torch.Generator().manual_seed(4)
    for trial in range(20):
        logits = torch.randn(len(PENALTIES), 48, generator=g) * 2
        reqs = [_req(i, outs, prompt=(3, 6, 9, 12), temperature=0.0, seed=trial if i % 2 else None, **kw)
                for i, (kw, outs) in enumerate(PENALTIES)]
        on = Sampler(seed=0, batch_on_device=True)(logits, reqs)
        off = Sampler(seed=0, batch_on_device=False)(logits, reqs)
        assert not on.errors and on.token_ids == off.token_ids


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


def test_only_unseeded_rows_take_the_batch(monkeypatch) -> None:
    import engine.sample.sampler as sampler_module

    taken: list[list[str]] = []
    real = sampler_module.draw
    monkeypatch.setattr(sampler_module, "draw",
                        lambda lg, rs, gen: taken.append([r.request_id for r in rs]) or real(lg, rs, gen))
    reqs = [_req(0, temperature=1.0), _req(1, temperature=1.0, seed=3), _req(2, temperature=0.0),
            _req(3, (5,), temperature=0.9, top_k=4, presence_penalty=0.5), _req(4, temperature=0.9, top_p=0.5),
            _req(5, temperature=0.9, logit_bias={3: 5.0}), _req(6, temperature=0.0, seed=2, repetition_penalty=1.2)]
    logits = torch.randn(len(reqs), 40, generator=torch.Generator().manual_seed(2))
    out = Sampler(seed=0, batch_on_device=True)(logits, reqs)
    # not: a seeded sampled row (1), a plain greedy row (2: picked before)
    assert not out.errors and taken == [["0", "3", "4", "5", "6"]]
    # A seeded row draws what it draws alone on the host path, whatever else is in the batch.
    alone = Sampler(seed=0, batch_on_device=False)(logits[1:2], [_req(1, temperature=1.0, seed=3)])
    assert out.token_ids[1] == alone.token_ids[0]
    assert out.token_ids[2] == int(logits[2].argmax())
    # On by default, on the CPU too; off, every row takes the host path.
    taken.clear()
    Sampler(seed=0)(logits, reqs)
    assert taken == [["0", "3", "4", "5", "6"]]
    taken.clear()
    Sampler(seed=0, batch_on_device=False)(logits, reqs)
    assert taken == []


def test_batch_controls_are_the_host_rule_row_for_row() -> None:
    """allowed_token_ids, bad words (single tokens and after a prefix) and logit_bias in the batch,
    against `apply_controls` row for row; a row they empty is flagged (the host raises for it)."""
    import random

    from engine.sample.batched import constrained
    from engine.sample.logit_controls import apply_controls

    rng, vocab = random.Random(5), 12
    for trial in range(40):
        reqs, want = [], []
        logits = torch.tensor([[rng.uniform(-5, 5) for _ in range(vocab)] for _ in range(6)])
        for i in range(6):
            output = tuple(rng.randrange(vocab) for _ in range(rng.randrange(0, 4)))
            bad = tuple(tuple(rng.randrange(vocab) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 6)))
            bias = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(0, 3))} or None
            allowed = rng.sample(range(vocab), rng.randrange(1, 5)) if rng.random() < 0.5 else None
            r = _req(i, output, bad=bad, temperature=0.0, logit_bias=bias, allowed_token_ids=allowed,
                     bad_words=["x"] if bad else None)
            reqs.append(r)
            try:
                want.append(apply_controls(logits[i].clone(), r.params, r.bad_word_ids, r.output_token_ids))
            except ValueError:
                want.append(None)
        got, ok = constrained(logits, reqs)
        if all(not (r.params.logit_bias or r.params.allowed_token_ids or r.params.bad_words) for r in reqs):
            assert ok is None
            continue
        for i, w in enumerate(want):
            assert bool(ok[i]) == (w is not None), (trial, i)
            if w is not None:
                assert torch.equal(got[i], w), (trial, i)


def test_a_row_its_controls_empty_fails_alone_in_the_batch() -> None:
    reqs = [_req(0, temperature=0.9), _req(1, bad=((3,),), temperature=0.0, allowed_token_ids=[3], bad_words=["x"]),
            _req(2, temperature=0.0)]
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    out = Sampler(seed=0, batch_on_device=True)(logits, reqs)
    assert list(out.errors) == [1] and "no token is left" in out.errors[1]
    assert out.token_ids[2] == int(logits[2].argmax()) and 0 <= out.token_ids[0] < 16


def test_grammar_masks_in_the_batch_are_the_host_rule_row_for_row() -> None:
    """Grammar rows (xgrammar bitmasks unpacked where the logits are) against `GrammarState.mask`
    plus controls on the host, along a regex's accepted text; greedy grammar rows give the host
    path's tokens and leave their matchers where the host path leaves them."""
    import pytest

    from engine.demo.demo_model import ensure_demo_model
    from engine.runner.loader import load_tokenizer
    from engine.sample.batched import constrained
    from engine.sample.structured import GrammarCompiler, StructuredOutputsParams

    try:
        tok = load_tokenizer(ensure_demo_model())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    vocab = 49152
    gc = GrammarCompiler(tok, vocab, frozenset({tok.eos_token_id}))
    params = StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}")

    def reqs(prefix: list[int]) -> list[Request]:
        """Rows 0, 1 and 3 constrained, their matchers past `prefix`; row 1 with controls too."""
        def matcher():
            m = gc.matcher(params)
            for t in prefix:
                m.accept(t)
            return m

        return [_req(0, temperature=0.0, grammar=matcher()),
                _req(1, temperature=0.0, logit_bias={16: 3.0, 17: -2.0}, grammar=matcher()),
                _req(2, temperature=0.0), _req(3, temperature=0.8, grammar=matcher())]

    g, text = torch.Generator().manual_seed(6), tok.encode("(415) 555", add_special_tokens=False)
    for step in range(len(text)):
        logits = torch.randn(4, vocab, generator=g) * 3
        host = reqs(text[:step])
        got, ok = constrained(logits, reqs(text[:step]))
        assert ok is not None and bool(ok.all())
        for i, r in enumerate(host):
            want = _apply_penalties(logits[i].clone(), r) if r.grammar is not None or r.params.logit_bias else logits[i]
            assert torch.equal(got[i], want), (step, i)
        on_reqs, off_reqs = reqs(text[:step])[:3], host[:3]
        on = Sampler(seed=0, batch_on_device=True)(logits[:3], on_reqs)
        off = Sampler(seed=0, batch_on_device=False)(logits[:3], off_reqs)
        assert not on.errors and on.token_ids == off.token_ids
        for a, b in zip(on_reqs, off_reqs):  # each matcher accepted its row's token
            if a.grammar is not None:
                assert torch.equal(a.grammar.bitmask(), b.grammar.bitmask()), step


def test_top_p_from_the_top_candidates_is_the_full_sorts_rule() -> None:
    """The CPU's top-p reads only the most likely 256 or 4096 tokens of a row when they already
    hold top_p (engine/sample/draw.py); a plain full-sort rule is the oracle, on rows that take each
    branch: peaked (the top 256 suffice), flatter (4096) and flat (the full sort), one at a time (the
    host path) and all in one batch with a row that has no top-p (each row takes its own branch)."""
    def reference(probs: torch.Tensor, top_p: float) -> torch.Tensor:
        sorted_p, idx = probs.sort(descending=True)
        drop = (sorted_p.cumsum(0) - sorted_p) >= top_p
        drop[0] = False
        return probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))

    g = torch.Generator().manual_seed(7)
    branches, rows, cuts, want = set(), [], [], []
    for scale in (12.0, 3.5, 0.5):
        for top_p in (0.5, 0.9, 0.95, 0.999):
            row = torch.randn(49152, generator=g) * scale
            probs = torch.softmax(row, dim=0)
            top = probs.topk(4096).values.cumsum(0)
            branches.add(256 if top[255] >= top_p + 1e-6 else 4096 if top[-1] >= top_p + 1e-6 else 0)
            got = _filtered_probs(row, 0, top_p, 0.0)
            assert torch.equal(got, reference(probs, top_p)), (scale, top_p)
            rows.append(row), cuts.append(top_p), want.append(got)
    assert branches == {256, 4096, 0}
    order = torch.randperm(len(rows), generator=g).tolist()
    rows, cuts, want = [rows[i] for i in order] + [rows[0]], [cuts[i] for i in order] + [1.0], [want[i] for i in order]
    n = len(rows)
    batch, _, _ = filtered_probs(torch.stack(rows), torch.ones(n), torch.zeros(n, dtype=torch.long),
                                 torch.tensor(cuts), torch.zeros(n))
    for i, w in enumerate(want):
        assert torch.equal(batch[i], w), (i, cuts[i])
    assert torch.equal(batch[-1], torch.softmax(rows[-1], dim=0))


def test_the_cpus_chunks_of_rows_draw_the_tokens_of_one_batch(monkeypatch) -> None:
    """On the CPU the batch is filtered and drawn a few rows at a time; the uniforms are drawn in
    row order either way, so the tokens are those of the whole batch at once."""
    import engine.sample.batched as batched

    reqs = [_req(i, temperature=0.9, top_k=[0, 20][i % 2], top_p=[1.0, 0.8, 0.95][i % 3]) for i in range(9)]
    logits = torch.randn(len(reqs), 300, generator=torch.Generator().manual_seed(4)) * 2
    tokens = {}
    for elements in (1, 1 << 30):  # two rows a chunk; all rows in one
        monkeypatch.setattr(batched, "CPU_CHUNK_ELEMENTS", elements)
        sampler = Sampler(seed=5)
        tokens[elements] = [sampler(logits, reqs).token_ids for _ in range(3)]
    assert tokens[1] == tokens[1 << 30]
    assert len({tuple(t) for t in tokens[1]}) > 1  # the three draws are not one fixed answer
