"""How many tokens to propose: cost-aware proposal lengths, learnt online.

A proposed token is worth its chance of being accepted and costs one more query token in the
verify forward. Where the forward is bound by reading weights (batch 1, or a GPU at moderate
batch) that extra token is nearly free; on a CPU with few cores the forward turns compute-bound
at small batches, and there each extra token costs about as much as a real one (measured on
the demo model, 2 cores, batch-16 decode: 31 ms a step, +1.0 ms per extra query token), so
proposals that are accepted half the time make the engine slower, not faster.

So position i of a proposal is made only while P_i = a_1 * ... * a_i, the chance that it is
accepted (a_j: of the proposals that reached position j, the share accepted there; recent
verifications weigh most), exceeds what it costs in units of one emitted token:
c1 / (T(B) / B), with T(B) = c0 + c1 * tokens the forward time of a decode step fitted online
(exponentially weighted least squares over decode-only steps) and B the sequences in the step.
While proposals are not worth making, one request in EXPLORE_EVERY steps still gets a full
proposal, so that acceptance is re-measured when the text turns repetitive again.
"""
from __future__ import annotations

DECAY = 0.98  # per observation: about the last 50 steps / verifications count
EXPLORE_EVERY = 8
# The fit sees the cost of extra query tokens, not that a request with proposals leaves the
# batched decode path for the chunk path; at chat's break-even acceptance (~0.5 against a fitted
# threshold of ~0.4 at batch 16) proposing still cost 8%. A proposal must clear the fitted cost
# by this factor.
COST_MARGIN = 1.5
PRIOR_ACCEPT = 0.8  # optimistic: proposals start, and measure themselves


class SpecBudget:
    def __init__(self, k: int) -> None:
        self.k = k
        self._reached = [1.0] * k  # decayed counts: proposals that reached position i
        self._accepted = [PRIOR_ACCEPT] * k  # ... and had it accepted
        self._fit = [0.0] * 5  # decayed n, sum x, sum y, sum xx, sum xy (x: tokens, y: seconds)
        self._steps = 0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step's forward: `num_tokens` query tokens in `seconds`."""
        f = self._fit
        x, y = float(num_tokens), seconds
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            f[i] = f[i] * DECAY + v

    def observe_verify(self, num_proposed: int, num_accepted: int) -> None:
        for i in range(self.k):
            self._reached[i] *= DECAY
            self._accepted[i] *= DECAY
        for i in range(min(num_proposed, num_accepted + 1)):
            self._reached[i] += 1.0
            if i < num_accepted:
                self._accepted[i] += 1.0

    def cost_per_token(self, batch: int) -> float:
        """c1 / (T(batch) / batch): 0 until the fit has seen different step sizes."""
        n, sx, sy, sxx, sxy = self._fit
        if n < 4:
            return 0.0
        var = sxx / n - (sx / n) ** 2
        if var < 1.0:  # every step the same size: no slope to read
            return 0.0
        c1 = max(0.0, (sxy / n - sx * sy / n / n) / var)
        c0 = sy / n - c1 * sx / n
        t = c0 + c1 * batch
        return c1 * batch / t if t > 0 else 0.0

    def lengths(self, limits: list[int]) -> list[int]:
        """Proposal lengths for a batch of requests (each at most its limit)."""
        self._steps += 1
        threshold = COST_MARGIN * self.cost_per_token(len(limits))
        n, p = 0, 1.0
        for i in range(self.k):
            p *= self._accepted[i] / self._reached[i] if self._reached[i] > 0 else PRIOR_ACCEPT
            if p <= threshold:
                break
            n = i + 1
        out = [min(n, lim) for lim in limits]
        if n == 0 and limits and self._steps % EXPLORE_EVERY == 0:
            i = (self._steps // EXPLORE_EVERY) % len(limits)
            out[i] = limits[i]
        return out
