"""How many tokens to propose: cost-aware proposal lengths, learnt online.

A proposed token is worth its chance of being accepted and costs one more query token in the
verify forward. Where the forward is bound by reading weights (batch 1, or a GPU at moderate
batch) that extra token is nearly free; on a CPU with few cores the forward turns compute-bound
at small batches, and there each extra token costs about as much as a real one (measured on
the demo model, 2 cores, batch-16 decode: 31 ms a step, +1.0 ms per extra query token), so
proposals that are accepted half the time make the engine slower, not faster.

So position i of a request's proposal is made only while P_i = a_1 * ... * a_i, the chance that it
is accepted (a_j: of the proposals that reached position j, the share accepted there; recent
verifications weigh most), exceeds what it costs in units of one emitted token. The a_j are the
request's own, shrunk toward the engine-wide ones by PRIOR_WEIGHT verifications' worth: in a
batch of chat answers a list or a quoted passage copies its prompt while free prose does not,
and one shared rate would give both the same lengths. The cost is
c1 / (T(B) / B), with T(B) = c0 + c1 * tokens the forward time of a decode step fitted online
(exponentially weighted least squares over decode-only steps) and B the sequences in the step.
While proposals are not worth making, one request in EXPLORE_EVERY steps still gets a full
proposal, so that acceptance is re-measured when the text turns repetitive again.
"""
from __future__ import annotations

from engine.core.request import RequestId
from engine.core.step_cost import DECAY, LinearFit

REQUEST_DECAY = 0.9  # per verification of the request: its last ~10 count
PRIOR_WEIGHT = 3.0  # the engine-wide rate counts as this many of the request's own verifications
EXPLORE_EVERY = 8
# The fit sees the cost of extra query tokens, not that a request with proposals leaves the
# batched decode path for the chunk path. A proposal must clear the fitted cost by this factor.
# With one engine-wide acceptance rate the margin had to be 1.5 (chat at batch 16 still 0.947x);
# with per-request rates 1.2 measured chat batch 16 0.974x and grounded batch 16 1.14x, where 1.5
# gave 0.989x and 1.08x (benchmarks/spec_decode.py, README).
COST_MARGIN = 1.2
PRIOR_ACCEPT = 0.8  # optimistic: proposals start, and measure themselves


class SpecBudget:
    def __init__(self, k: int) -> None:
        self.k = k
        self._reached = [1.0] * k  # decayed counts: proposals that reached position i
        self._accepted = [PRIOR_ACCEPT] * k  # ... and had it accepted
        self._fit = LinearFit()  # decode-only steps' forward time against their query tokens
        self._steps = 0
        self._own: dict[RequestId, tuple[list[float], list[float]]] = {}  # per request: reached, accepted

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step's forward: `num_tokens` query tokens in `seconds`."""
        self._fit.observe(num_tokens, seconds)

    def observe_verify(self, req_id: RequestId, num_proposed: int, num_accepted: int) -> None:
        own = self._own.setdefault(req_id, ([0.0] * self.k, [0.0] * self.k))
        for (reached, accepted), decay in (((self._reached, self._accepted), DECAY), (own, REQUEST_DECAY)):
            for i in range(self.k):
                reached[i] *= decay
                accepted[i] *= decay
            for i in range(min(num_proposed, num_accepted + 1)):
                reached[i] += 1.0
                if i < num_accepted:
                    accepted[i] += 1.0

    def release(self, req_id: RequestId) -> None:
        self._own.pop(req_id, None)

    def _rates(self, req_id: RequestId) -> list[float]:
        """The request's acceptance rate per position, shrunk toward the engine-wide one."""
        own_reached, own_accepted = self._own.get(req_id, ((0.0,) * self.k, (0.0,) * self.k))
        rates = []
        for i in range(self.k):
            base = self._accepted[i] / self._reached[i] if self._reached[i] > 0 else PRIOR_ACCEPT
            rates.append((own_accepted[i] + PRIOR_WEIGHT * base) / (own_reached[i] + PRIOR_WEIGHT))
        return rates

    def cost_per_token(self, batch: int) -> float:
        """c1 / (T(batch) / batch): 0 until the fit has seen different step sizes."""
        c = self._fit.coefficients()
        if c is None:
            return 0.0
        c0, c1 = c
        t = c0 + c1 * batch
        return c1 * batch / t if t > 0 else 0.0

    def lengths(self, req_ids: list[RequestId], limits: list[int]) -> list[int]:
        """Proposal lengths for a batch of requests (each at most its limit)."""
        self._steps += 1
        threshold = COST_MARGIN * self.cost_per_token(len(limits))
        out = []
        for req_id, lim in zip(req_ids, limits):
            n, p = 0, 1.0
            for i, rate in enumerate(self._rates(req_id)[:lim]):
                p *= rate
                if p <= threshold:
                    break
                n = i + 1
            out.append(n)
        if not any(out) and limits and self._steps % EXPLORE_EVERY == 0:
            i = (self._steps // EXPLORE_EVERY) % len(limits)
            out[i] = limits[i]
        return out
