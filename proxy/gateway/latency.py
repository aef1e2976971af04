"""What the gateway learns of each unit's latency, online, from what it observes.

A unit's time to first token (TTFT) is modelled as linear in what the request finds
there when it is sent:

    ttft = a + b * ahead + c * prompt_kchars

``ahead``: the requests the unit already holds (its estimated outstanding, before this
one: their prefill and decode share the engine's steps with it); ``prompt_kchars``: the
part of the prompt the unit must prefill, in thousands of characters (the part its KV
cache is not known to hold). ``a`` is the unit's fixed cost (network, scheduling, a
short prefill), ``b`` what each request ahead adds, ``c`` its prefill speed.

Its time per output token (TPOT) after the first, linear in the batch it decodes in:

    tpot = d + e * (ahead + 1)

``Regression`` fits (a, b, c), and (d, e), by recursive least squares with forgetting: each
observation costs a few dozen multiplications, there is nothing to store but a 3x3
matrix, and old observations fade with time (``half_life_s`` on the injected clock),
so a unit that slows down (or is replaced) is learnt again in a few half-lives. A unit
is ``warm`` once it has ``WARM`` observations; before that it has no prediction. (Plain classes, compiled by mypyc: one call per answered attempt.)
"""

from __future__ import annotations

from collections.abc import Callable

WARM = 5  # observations before a unit's own fit is trusted
PRIOR = 1000.0  # the initial covariance: the coefficients are unknown
MAX_TRACE = 1e6  # the covariance is scaled back past this (no wind-up while idle)
MIN_FORGET = 0.8  # however long since the last observation, keep this much of the past
MAX_FORGET = 0.999  # however soon, forget this much: a flood still adapts
KCHARS = 0.001  # prompt characters to thousands


class Regression:
    """Recursive least squares of y on (1, x1, x2), with forgetting by elapsed time."""

    __slots__ = ("_last", "half_life_s", "n", "p", "theta")

    def __init__(self, half_life_s: float):
        self.half_life_s = half_life_s
        self.theta = [0.0, 0.0, 0.0]
        self.p = [PRIOR, 0.0, 0.0, 0.0, PRIOR, 0.0, 0.0, 0.0, PRIOR]  # row-major 3x3
        self.n = 0
        self._last = -1.0

    def predict(self, x1: float, x2: float) -> float:
        t = self.theta
        return t[0] + t[1] * x1 + t[2] * x2

    def update(self, x1: float, x2: float, y: float, now: float) -> None:
        forget = MAX_FORGET
        if self._last >= 0.0 and self.half_life_s > 0.0:
            forget = min(
                MAX_FORGET, max(MIN_FORGET, 0.5 ** ((now - self._last) / self.half_life_s))
            )
        self._last = now
        p = self.p
        x0 = 1.0
        # px = P x
        px0 = p[0] * x0 + p[1] * x1 + p[2] * x2
        px1 = p[3] * x0 + p[4] * x1 + p[5] * x2
        px2 = p[6] * x0 + p[7] * x1 + p[8] * x2
        denom = forget + x0 * px0 + x1 * px1 + x2 * px2
        k0, k1, k2 = px0 / denom, px1 / denom, px2 / denom
        err = y - self.predict(x1, x2)
        t = self.theta
        t[0] += k0 * err
        t[1] += k1 * err
        t[2] += k2 * err
        # P = (P - k (P x)^T) / forget; P is symmetric, so (P x)^T = x^T P.
        k = (k0, k1, k2)
        px = (px0, px1, px2)
        trace = 0.0
        for i in range(3):
            for j in range(3):
                p[i * 3 + j] = (p[i * 3 + j] - k[i] * px[j]) / forget
            trace += p[i * 4]
        if trace > MAX_TRACE:
            scale = MAX_TRACE / trace
            for i in range(9):
                p[i] *= scale
        self.n += 1

    @property
    def warm(self) -> bool:
        return self.n >= WARM


class Latencies:
    """Every unit's TTFT fit, the error of each prediction made before an observation,
    and the prompt length the fleet sees (for the load a unit can hold within an
    objective)."""

    __slots__ = ("_clock", "half_life_s", "mean_kchars", "on_error", "tpot", "units")

    def __init__(self, clock: Callable[[], float], half_life_s: float):
        self._clock = clock
        self.half_life_s = half_life_s
        self.units: dict[str, Regression] = {}  # TTFT
        self.tpot: dict[str, Regression] = {}
        self.mean_kchars = 0.0  # a moving mean of the prompts' uncached part
        # Called with |predicted - actual| / actual for each observation of a warm unit.
        self.on_error: Callable[[float], None] | None = None

    def of(self, unit_id: str) -> Regression:
        fit = self.units.get(unit_id)
        if fit is None:
            fit = self.units[unit_id] = Regression(self.half_life_s)
        return fit

    def warm(self, unit_id: str) -> bool:
        fit = self.units.get(unit_id)
        return fit is not None and fit.warm

    def predict(self, unit_id: str, ahead: float, chars: float) -> float:
        """The unit's predicted TTFT in s (-1 when it is not warm), never below 0."""
        fit = self.units.get(unit_id)
        if fit is None or not fit.warm:
            return -1.0
        return max(0.0, fit.predict(ahead, chars * KCHARS))

    def observe(self, unit_id: str, ahead: float, chars: float, ttft_s: float) -> None:
        """An attempt on the unit got its first token ``ttft_s`` after it was sent, with
        ``ahead`` requests there and ``chars`` prompt characters to prefill."""
        fit = self.of(unit_id)
        kchars = chars * KCHARS
        if fit.warm and ttft_s > 0.0 and self.on_error is not None:
            predicted = max(0.0, fit.predict(ahead, kchars))
            self.on_error(abs(predicted - ttft_s) / ttft_s)
        fit.update(ahead, kchars, ttft_s, self._clock())
        self.mean_kchars += 0.05 * (kchars - self.mean_kchars)

    def observe_tpot(self, unit_id: str, ahead: float, per_token_s: float) -> None:
        """The attempt's stream came ``per_token_s`` per token after its first, in a
        batch of ``ahead`` + 1."""
        fit = self.tpot.get(unit_id)
        if fit is None:
            fit = self.tpot[unit_id] = Regression(self.half_life_s)
        fit.update(ahead + 1.0, 0.0, per_token_s, self._clock())

    def predict_tpot(self, unit_id: str, ahead: float) -> float:
        """The unit's predicted time per output token for a request sent with ``ahead``
        there (-1 when not warm)."""
        fit = self.tpot.get(unit_id)
        if fit is None or not fit.warm:
            return -1.0
        return max(0.0, fit.predict(ahead + 1.0, 0.0))

    def holds(self, unit_id: str, slo_ttft_s: float, slo_tpot_s: float, capacity: int) -> float:
        """How many requests the unit can hold with a request of the fleet's mean prompt
        still predicted to start within ``slo_ttft_s`` and to stream within
        ``slo_tpot_s`` (0: no such objective): at most ``capacity``, and ``capacity``
        by an objective whose fit is not warm (nothing learnt says otherwise)."""
        most = float(capacity)
        fit = self.units.get(unit_id)
        if fit is not None and fit.warm and slo_ttft_s > 0.0:
            a, b, c = fit.theta
            # ahead + 1: those ahead, and the one arriving
            most = min(most, _most(slo_ttft_s - a - c * self.mean_kchars, b, 1.0))
        fit = self.tpot.get(unit_id)
        if fit is not None and fit.warm and slo_tpot_s > 0.0:
            d, e, _ = fit.theta
            most = min(most, _most(slo_tpot_s - d, e, 0.0))  # batch = what it holds
        return most


def _most(spare: float, per_request: float, plus: float) -> float:
    """The requests that fit in ``spare`` s at ``per_request`` s each, plus ``plus``."""
    if spare < 0.0:
        return 0.0
    if per_request <= 0.0:
        return float("inf")
    return spare / per_request + plus
