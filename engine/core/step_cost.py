"""What a step's forward costs, learnt online: T(tokens) = c0 + c1 * tokens.

`LinearFit` is the exponentially weighted least-squares fit (recent observations weigh most)
that speculative decoding's proposal lengths (engine/spec/budget.py) and the scheduler's share
for expensive work (`ShareController`, engine/core/scheduler.py) both read. c0 is what every step pays whatever it
carries (reading the weights, launching kernels, Python); c1 is one more query token. On a
2-core CPU with the demo model c0 is about 35 ms and c1 about 1.3 ms, so one decode step costs
as much as ~27 prompt tokens; on a GPU c0/c1 is in the thousands.

The scheduler's share for prompt log-prob work (issue 38): such a request recomputes its
whole prompt and scores every position against the vocabulary. While other requests have work,
the prompt tokens of log-prob requests (all together) are paid from a bucket that each step
fills with PROMPT_LOGPROBS_SHARE of the others' step time and that each bite empties by what
it measured (`ShareController`): the others' steps take about that much
longer on average. Alone, bites of PROMPT_LOGPROBS_ALONE plain steps' cost: a request that
arrives waits for the step in flight, which must stay short (one 2048-token bite with
log-probs took 4 s on the demo model, and every request arriving then waited that long).
The requests that waited for such a request's prefill (its other sequences) are paid from
the same bucket for their whole life: 15 sequences reading a 3.6k-token prompt's blocks then
computing their tails and decoding at that context are the same request's cost.
"""
from __future__ import annotations

# Prompt log-prob work beside others gets this share of their step time, in bites of at most
# PROMPT_LOGPROBS_ALONE plain steps' cost, which is also its bite alone (~0.13-0.17 s on the demo
# model, 2 CPU cores). A probe decoding beside it pays the share on each of its steps plus, when it
# arrives between two of its requests, the alone bite in flight: at 0.5 the probe measured 1.8-1.9x
# its idle latency (1.5x of it the share), at 0.3 1.5-1.8x in six runs, and the request took 49-55 s
# instead of 41 s. Bites of 2 plain steps instead of 3 made the request 62 s and the probe no faster.
# Until steps are measured, fixed counts.
PROMPT_LOGPROBS_SHARE = 0.3
PROMPT_LOGPROBS_ALONE = 3.0
PROMPT_LOGPROBS_UNFITTED = 16
PROMPT_LOGPROBS_UNFITTED_ALONE = 128

DECAY = 0.98  # per observation: about the last 50 count
MIN_OBSERVATIONS = 4


class LinearFit:
    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # decayed n, sum x, sum y, sum xx, sum xy (x: tokens, y: seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        x, y = float(tokens), seconds
        s = self._sums
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = s[i] * self.decay + v

    def coefficients(self) -> tuple[float, float] | None:
        """(c0, c1), or None until steps of different sizes were seen."""
        n, sx, sy, sxx, sxy = self._sums
        if n < MIN_OBSERVATIONS:
            return None
        var = sxx / n - (sx / n) ** 2
        if var < 1.0:  # every step the same size: no slope to read
            return None
        c1 = max(0.0, (sxy / n - sx * sy / n / n) / var)
        return sy / n - c1 * sx / n, c1

    def mean(self) -> float | None:
        """Mean y (a flat line), after MIN_OBSERVATIONS."""
        n, _, sy, _, _ = self._sums
        return sy / n if n >= MIN_OBSERVATIONS else None

    def ratio(self) -> float | None:
        """Mean y per mean x (a line through the origin), once anything was seen."""
        n, sx, sy, _, _ = self._sums
        return sy / sx if n > 0 and sx > 0 else None


class ShareController:
    """How many tokens of expensive work (prompt log-probs: a prompt token plus a row scored
    against the vocabulary) a step may carry, so that the steps the others run in take about
    `share` longer on average.

    A bucket of seconds: every step with other work adds `share` of what that work alone would
    take (the fit over steps without expensive work), up to `alone` such steps; a step with
    expensive work spends what it took beyond that. A step carries the tokens the bucket covers
    at their measured cost (a second fit: extra seconds against expensive tokens, whose fixed
    part is large on a CPU, where one more row turns a 1-row decode into a GEMM). So the work
    comes in bites every few steps rather than a token per step that costs more than its share.
    Alone, bites of `alone` plain steps' cost. Before any measurement, fixed counts."""

    def __init__(self, share: float, alone: float, unfitted: int, unfitted_alone: int) -> None:
        self.share, self.alone, self.unfitted, self.unfitted_alone = share, alone, unfitted, unfitted_alone
        self.fit = LinearFit()  # steps without expensive work: time against tokens
        self.extra = LinearFit()  # steps with it: time beyond the fit against expensive tokens
        self.credit = 0.0  # seconds of expensive work the bucket holds

    def _plain(self, tokens: int) -> float | None:
        c = self.fit.coefficients()
        if c is None:
            # Every plain step of late had one size (a probe's decodes: its prefills ride with a
            # bite, so the fit never sees them): their mean is their cost. Falling back to the
            # unfitted counts here granted 16-128 tokens a step, and a probe beside the request
            # waited 3.5x its idle time.
            mean = self.fit.mean()
            return None if mean is None else max(mean, 1e-6)
        return max(c[0] + c[1] * tokens, 1e-6)

    def observe(self, tokens: int, seconds: float, expensive: int, allowed: int | None) -> None:
        """A step's forward: `tokens` in all, `expensive` of them the capped kind, `allowed` its cap."""
        if not expensive:
            self.fit.observe(tokens, seconds)
            return
        plain = self._plain(tokens - expensive)
        if plain is None:
            return
        extra = max(seconds - plain, 0.0)
        self.extra.observe(expensive, extra)
        if tokens > expensive:  # beside others: paid from the bucket
            self.credit -= extra

    def allowance(self, others: int) -> int:
        """Expensive tokens for a step whose other work is `others` tokens (0: alone)."""
        plain = self._plain(others)
        if plain is None:
            return self.unfitted if others else self.unfitted_alone
        if others:
            self.credit = min(self.credit + self.share * plain, self.alone * plain)
            budget = self.credit
        else:
            budget = self.alone * plain
        c = self.extra.coefficients()
        if c is None:  # bites of one size so far: their mean cost per token (fixed part included)
            r = self.extra.ratio()
            c = (0.0, r) if r is not None else None
        if c is None:
            return self.unfitted if budget > 0 else 0
        fixed, per_token = max(c[0], 0.0), max(c[1], 1e-6)
        n = max(0, int((budget - fixed) / per_token + 1e-6))  # (the epsilon: float error at whole tokens)
        # A full bucket (or a step alone) always buys a token: when a bite's measured fixed part is
        # more than `alone` plain steps (a loaded machine, a noisy fit), the work would otherwise never
        # run alone (the engine found no progress with it pending) nor beside others.
        return max(n, 1) if budget >= self.alone * plain - 1e-9 else n
