"""Sampled, penalised, controlled and constrained rows drawn together on the logits' device (issue 42).

The host sampler (engine/sample/sampler.py) takes each such row to the host and processes it
there: on a GPU, a batch of 64 was 64 device-to-host copies of a whole vocabulary row and 64 host
softmaxes and sorts per step. Here the rows shaped by grammar masks (sent as bitmasks, 1/32 of a
row), logit controls (allowed_token_ids, bad_words, logit_bias), temperature, top-k, top-p, min-p,
repetition/presence/frequency penalties and min_tokens are processed as one batch where the logits
are: masks, controls and penalties from index tensors built once per step, the filter batched,
greedy rows by argmax and sampled rows by one batched draw (engine/sample/draw.py). A grammar row's token is then
accepted by its matcher on the host; thinking budgets stay on the host path. Every host value the
batch needs goes to the device through page-locked memory without blocking (engine/runner/h2d.py),
so nothing here waits for the forward: with async scheduling the ids can stay on the device for
the next step (engine/sample/device_tokens.py).

Sampled rows take this path only when unseeded (greedy rows draw nothing, so any greedy row may).
Their noise comes from a generator on the logits' device, seeded with the engine's seed, so a run
is reproducible on the same device. A seeded request keeps its own host generator and the host
path, so it draws the same tokens on any device, whatever else is in the batch. The masks are
`GrammarState.mask`'s rule, the controls `apply_controls`'s, the filter `_filtered_probs`'s and the
penalties `_apply_penalties`'s, row for row (tests compare them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.runner.h2d import host_to_device, to_device
from engine.sample.draw import categorical, top_p_filtered
from engine.sample.logit_controls import has_controls

INF = float("inf")
CPU_CHUNK_ELEMENTS = 1 << 18  # logits per chunk of rows filtered and drawn together on the CPU (two rows at least)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs `[n, vocab]` float32, degenerate `[n]` bool, fallback `[n]`): each row's distribution
    under its own settings (per-row host tensors: float32 temperature, top_p, min_p, int64 top_k),
    as `_filtered_probs` makes it; a degenerate row (inf/NaN logits, nothing left) is drawn as
    `fallback`, the argmax of its tempered logits. Which filters run is decided from the host
    tensors, so nothing here waits for the device."""
    dev, vocab = logits.device, logits.shape[1]
    use_k, use_p, use_min = (top_k > 0) & (top_k < vocab), top_p < 1.0, min_p > 0

    def on(t: torch.Tensor) -> torch.Tensor:
        return host_to_device(t, dev)[:, None]

    rows = tempered = logits.float() / on(temperature)
    if bool(use_k.any()):
        kmax = int(torch.where(use_k, top_k, 1).max())
        at = on(top_k.clamp(1, kmax) - 1)
        kth = rows.topk(kmax, dim=1).values.gather(1, at)
        if not bool(use_k.all()):
            kth = kth.masked_fill(~on(use_k), -INF)  # [n, 1]: nothing is below it
        rows = torch.where(rows < kth, -INF, rows)
    probs = torch.softmax(rows, dim=1)
    degenerate = ~torch.isfinite(probs.sum(dim=1))  # probs >= 0: the sum is finite iff each entry is
    if bool(use_p.any()):  # only the rows that use it: the CPU's candidates hold their top_p only
        if bool(use_p.all()):
            probs = top_p_filtered(probs, on(top_p))
        else:
            at = host_to_device(use_p.nonzero().squeeze(1), dev)
            probs = probs.index_copy(0, at, top_p_filtered(probs[at], on(top_p[use_p])))
    if bool(use_min.any()):
        probs = probs.masked_fill(probs < (on(min_p) * probs.max(dim=1, keepdim=True).values), 0.0)
    if bool(use_p.any()) or bool(use_min.any()):  # else the sum above is that of probs
        degenerate |= ~(probs.sum(dim=1) > 0.0)
    # Only degenerate rows need the argmax pass. On the CPU, whether there are any is free to ask
    # (it was a quarter of a 64-row draw over 49,152 tokens); on a GPU asking would wait for it.
    if dev.type != "cpu" or bool(degenerate.any()):
        fallback = tempered.argmax(dim=1)
    else:
        fallback = torch.zeros(len(rows), dtype=torch.long)
    return probs, degenerate, fallback


def row_settings(reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host tensors (float32 temperature, int64 top_k, float32 top_p, float32 min_p), one entry per
    request of `reqs`, as `filtered_probs` takes them."""
    t, k, p, m = torch.tensor([[r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p] for r in reqs],
                              dtype=torch.float64).unbind(1)
    return t.float(), k.long(), p.float(), m.float()


def distributions(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """`sampling_distribution` for a batch: float64 `[n, vocab]` on the logits' device, row i what
    `reqs[i]` (sampled, no penalties) draws from at logits row i, normalised; a degenerate row is a
    point mass on its argmax."""
    probs, degenerate, fallback = filtered_probs(logits.float(), *row_settings(reqs))
    target = probs.double()
    if logits.device.type != "cpu" or bool(degenerate.any()):
        point = torch.nn.functional.one_hot(fallback, target.shape[1]).double()
        target = torch.where(degenerate[:, None], point, torch.nan_to_num(target))
    return target / target.sum(dim=1, keepdim=True)  # top-p / min-p leave it unnormalised


def penalised(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """`logits` (float32 `[n, vocab]`, not modified) with each row's min_tokens suppression,
    repetition, presence and frequency penalties applied, in `_apply_penalties`'s order and
    arithmetic; `logits` itself when no row has any. Each kind is one indexed operation over the batch."""
    dev, vocab = logits.device, logits.shape[1]
    stops = [(i, t) for i, r in enumerate(reqs) if r.num_output_suppressed() for t in r.stop_ids if t < vocab]
    seen = [(i, t) for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0 for t in sorted(set(r.all_token_ids))]
    counted = [i for i, r in enumerate(reqs)
               if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids]
    if not (stops or seen or counted):
        return logits
    out = logits.clone()

    if stops:
        out.index_put_(_index(stops, dev), torch.full((), -INF, dtype=out.dtype, device=dev))
    if seen:
        rows, cols = _index(seen, dev)
        # float32 factors: the host divides by the penalty as a scalar, which torch rounds to float32
        rp = to_device([reqs[i].params.repetition_penalty for i, _ in seen], dev, out.dtype)
        vals = out[rows, cols]
        out[rows, cols] = torch.where(vals > 0, vals / rp, vals * rp)
    if counted:
        pairs = [(j, t) for j, i in enumerate(counted) for t in reqs[i].output_token_ids]
        rows, cols = _index(pairs, dev)
        counts = torch.zeros(len(counted), vocab, dtype=out.dtype, device=dev)
        counts.index_put_((rows, cols), torch.ones((), dtype=out.dtype, device=dev), accumulate=True)
        freq, pres = to_device([[reqs[i].params.frequency_penalty, reqs[i].params.presence_penalty]
                                for i in counted], dev, out.dtype).unbind(1)
        at = to_device(counted, dev)
        out[at] -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(out.dtype)
    return out


def _index(pairs: list[tuple[int, int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) index tensors of `pairs` on `dev`."""
    return to_device(pairs, dev).unbind(1)


def constrained(logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`logits` after each row's grammar mask and logit controls, `ok`): `logits` (float32
    `[n, vocab]`) is not modified; `ok` `[n]` bool on the device is False for a row they leave
    without a finite logit (the host path raises for it, naming which). (`logits`, None) when no
    row has either."""
    checked = [has_controls(r.params) or r.active_grammar() is not None for r in reqs]
    if not any(checked):
        return logits, None
    out = controlled(grammar_masked(logits, reqs), reqs)
    return out, torch.isfinite(out).any(dim=1) | ~to_device(checked, logits.device, torch.bool)


def grammar_masked(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """`logits` (not modified) with each constrained row's grammar mask applied, `GrammarState.mask`'s
    rule: a 0 bit puts its token at -inf, over the first min(vocab, 32 × words) tokens (xgrammar
    leaves a padded tail alone). The bitmasks are copied here, before the mask thread refills them."""
    rows = [(i, g) for i, r in enumerate(reqs) if (g := r.active_grammar()) is not None]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    bits = torch.cat([g.bitmask() for _, g in rows])
    n = min(vocab, bits.shape[1] * 32)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((host_to_device(bits, dev)[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :n].bool()
    at = to_device([i for i, _ in rows], dev)
    out = logits.clone()
    out[at, :n] = out[at, :n].masked_fill(~allowed, -INF)
    return out


def controlled(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """`logits` (float32 `[n, vocab]`, not modified) with allowed_token_ids, bad words and
    logit_bias applied in `apply_controls`'s order and arithmetic; `logits` itself when no row has
    controls."""
    ctl = [i for i, r in enumerate(reqs) if has_controls(r.params)]
    if not ctl:
        return logits
    dev, (n, vocab) = logits.device, logits.shape
    out = logits.clone()
    allowed = [(i, t) for i in ctl for t in reqs[i].params.allowed_token_ids or ()]
    if allowed:
        keep = torch.ones(n, vocab, dtype=torch.bool, device=dev)
        keep[to_device(sorted({i for i, _ in allowed}), dev)] = False
        keep.index_put_(_index(allowed, dev), torch.ones((), dtype=torch.bool, device=dev))
        out.masked_fill_(~keep, -INF)
    banned = [(i, cols) for i in ctl if (cols := _banned(reqs[i], dev)) is not None]
    if banned:  # a request's single-token words stay one tensor (a list of 100k made each step build them)
        rows = torch.cat([torch.full((cols.numel(),), i, dtype=torch.long, device=dev) for i, cols in banned])
        out.index_put_((rows, torch.cat([cols for _, cols in banned])),
                       torch.full((), -INF, dtype=out.dtype, device=dev))
    bias = [(i, t, b) for i in ctl for t, b in (reqs[i].params.logit_bias or {}).items()]
    if bias:
        rows, cols = _index([(i, t) for i, t, _ in bias], dev)
        out.index_put_((rows, cols), to_device([b for _, _, b in bias], dev, out.dtype), accumulate=True)
    return out


def _banned(req: Request, dev: torch.device) -> torch.Tensor | None:
    """The token ids `req`'s bad words ban at its next position, on `dev`; None for none."""
    bad = req.bad_word_ids
    parts = [host_to_device(bad.singles, dev)] if bad.singles is not None else []
    if bad.by_prefix and (after := bad.banned_after(req.output_token_ids)):
        parts.append(to_device(after, dev))
    return torch.cat(parts) if parts else None


@dataclass(frozen=True, eq=False)
class Drawn:
    """A batch's tokens where its logits are."""
    ids: torch.Tensor  # [n] int64: each row's token (a valid id even for a row that is not `ok`)
    ok: torch.Tensor | None  # [n] bool: False where grammar or controls left nothing; None: no row has either

    def host(self) -> list[int]:
        """The tokens on the host, -1 for a row that is not `ok` (waits for the device)."""
        return (self.ids if self.ok is None else torch.where(self.ok, self.ids, -1)).tolist()


@torch.inference_mode()
def draw(logits: torch.Tensor, reqs: list[Request], gen: torch.Generator) -> Drawn:
    """Tokens for `reqs` (all `Sampler.batchable`), one row of `logits` each, drawn on the logits'
    device without waiting for it."""
    dev = logits.device
    logits, ok = constrained(logits.float(), reqs)
    logits = penalised(logits, reqs)
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    out = torch.empty(len(reqs), dtype=torch.long, device=dev)
    if greedy:  # the first maximum, as the host's argmax picks it
        at = to_device(greedy, dev)
        out[at] = (logits if len(greedy) == len(reqs) else logits[at]).max(dim=1).indices
    if sampled:
        t, k, p, m = row_settings([reqs[i] for i in sampled])  # host: filtered_probs decides without waiting
        at = to_device(sampled, dev)
        rows = logits if len(sampled) == len(reqs) else logits[at]
        # On the CPU, a few rows at a time: a chunk's temporaries stay in cache through the filter's
        # passes (64 rows of 151,936 tokens at once ran 1.5x slower than row by row). The uniforms
        # are drawn in row order either way, so the tokens do not depend on the chunking.
        step = len(sampled) if dev.type != "cpu" else max(2, CPU_CHUNK_ELEMENTS // rows.shape[1])
        for lo in range(0, len(sampled), step):
            hi = lo + step
            probs, degenerate, fallback = filtered_probs(rows[lo:hi], t[lo:hi], k[lo:hi], p[lo:hi], m[lo:hi])
            if dev.type != "cpu" or bool(degenerate.any()):  # NaN rows (asking is free on the CPU)
                probs = torch.nan_to_num(probs)
            out[at[lo:hi]] = torch.where(degenerate, fallback, categorical(probs, gen))
    return Drawn(out, ok)
