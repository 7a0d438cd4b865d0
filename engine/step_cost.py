"""What a step's forward costs, learnt online: T(tokens) = c0 + c1 * tokens.

`LinearFit` is the exponentially weighted least-squares fit (recent observations weigh most)
that speculative decoding's proposal lengths (engine/spec_budget.py) and the scheduler's share
for expensive work (engine/scheduler.py) both read. c0 is what every step pays whatever it
carries (reading the weights, launching kernels, Python); c1 is one more query token. On a
2-core CPU with the demo model c0 is about 35 ms and c1 about 1.3 ms, so one decode step costs
as much as ~27 prompt tokens; on a GPU c0/c1 is in the thousands.
"""
from __future__ import annotations

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


class StepCost:
    """Every step's forward time against its tokens (fed by the engine)."""

    def __init__(self) -> None:
        self.fit = LinearFit()

    def observe(self, tokens: int, seconds: float) -> None:
        self.fit.observe(tokens, seconds)

    def tokens_for(self, base_tokens: int, share: float) -> int | None:
        """How many more tokens cost `share` of a step that carries `base_tokens` (at least 1);
        None until the fit has a slope."""
        c = self.fit.coefficients()
        if c is None or c[1] <= 0:
            return None
        c0, c1 = c
        return max(1, int(share * (max(c0, 0.0) / c1 + base_tokens)))
