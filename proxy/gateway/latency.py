"""What the gateway learns of each unit's latency, online, from what it observes.

A unit's time to first token (TTFT) is modelled as linear in what the request finds
there when it is sent:

    ttft = a + b * ahead + c * prefill_kchars + q * wait

``ahead``: the requests the unit already holds (its estimated outstanding, before this
one: their prefill and decode share the engine's steps with it); ``prefill_kchars``:
the prefill work before this request's first token, in thousands of characters: the
part of its own prompt the unit must prefill (the part its KV cache is not known to
hold) and the same of every request sent there earlier that has no first token yet
(``Sent``: an engine prefills first come, first served, so their prompts go first);
``wait``: the wait for a batch slot, as the caller reckons it: the policy, from the
output each running request has left (``slot_wait``: when every slot is taken, the
request starts when one ends), in s, so that ``q`` is near 1 (a count of the requests
waiting serves too, with ``holds``'s turnover 1). ``a`` is the unit's fixed cost
(network, scheduling, a short prefill), ``b`` what each request ahead adds to a step,
``c`` its prefill speed, ``q`` what the wait adds.

Its time per output token (TPOT) after the first, linear in the batch it decodes in:

    tpot = d + e * (ahead + 1)

``Regression`` fits (a, b, c, q), and (d, e), by recursive least squares with forgetting: each
observation costs a few dozen multiplications, there is nothing to store but a 4x4
matrix, and old observations fade with time (``half_life_s`` on the injected clock),
so a unit that slows down (or is replaced) is learnt again in a few half-lives. A unit
is ``warm`` once it has ``WARM`` observations; before that it has no prediction. (Plain classes, compiled by mypyc: one call per answered attempt.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

WARM = 5  # observations before a unit's own fit is trusted
PRIOR = 1000.0  # the initial covariance: the coefficients are unknown
MIN_FORGET = 0.8  # however long since the last observation, keep this much of the past
MAX_FORGET = 0.999  # however soon, forget this much: a flood still adapts
KCHARS = 0.001  # prompt characters to thousands


DIMS = 4  # (1, x1, x2, x3)


class Regression:
    """Recursive least squares of y on (1, x1, x2, x3), with forgetting by elapsed time."""

    __slots__ = ("_last", "half_life_s", "n", "p", "theta")

    def __init__(self, half_life_s: float):
        self.half_life_s = half_life_s
        self.theta = [0.0] * DIMS
        self.p = [PRIOR if i % (DIMS + 1) == 0 else 0.0 for i in range(DIMS * DIMS)]
        self.n = 0
        self._last = -1.0

    def predict(self, x1: float, x2: float, x3: float = 0.0) -> float:
        t = self.theta
        return t[0] + t[1] * x1 + t[2] * x2 + t[3] * x3

    def update(self, x1: float, x2: float, y: float, now: float, x3: float = 0.0) -> None:
        forget = MAX_FORGET
        if self._last >= 0.0 and self.half_life_s > 0.0:
            forget = min(
                MAX_FORGET, max(MIN_FORGET, 0.5 ** ((now - self._last) / self.half_life_s))
            )
        self._last = now
        p, t = self.p, self.theta
        x = [1.0, x1, x2, x3]
        px = [0.0] * DIMS  # P x
        denom = forget
        for i in range(DIMS):
            row = i * DIMS
            v = p[row] * x[0] + p[row + 1] * x[1] + p[row + 2] * x[2] + p[row + 3] * x[3]
            px[i] = v
            denom += x[i] * v
        err = y - self.predict(x1, x2, x3)
        k = [v / denom for v in px]
        for i in range(DIMS):
            t[i] += k[i] * err
        # P = (P - k (P x)^T) / forget; P is symmetric, so (P x)^T = x^T P.
        for i in range(DIMS):
            for j in range(DIMS):
                p[i * DIMS + j] = (p[i * DIMS + j] - k[i] * px[j]) / forget
        # No wind-up: a direction no observation excites (an idle unit's queue, say)
        # grows by 1 / forget at each; its variance is brought back to PRIOR (row and
        # column scaled: P stays positive definite), the others' left as they are.
        for i in range(DIMS):
            var = p[i * (DIMS + 1)]
            if var > PRIOR:
                scale = (PRIOR / var) ** 0.5
                for j in range(DIMS):
                    p[i * DIMS + j] *= scale
                    p[j * DIMS + i] *= scale
        self.n += 1

    @property
    def warm(self) -> bool:
        return self.n >= WARM


class Timed(Protocol):
    """An attempt, as far as the model asks: its first token's time once it came."""

    def first_token_s(self) -> float:
        """Seconds from the attempt's start to its first token; -1 until it came."""


class Sent:
    """One attempt sent to a unit, as the model saw it then: what it found there
    (``ahead``, ``prefill_chars`` before its first token, ``own_chars`` of its own,
    the ``wait`` for a slot), the TTFT predicted for it (-1: the unit was not warm), and
    the attempt (its first token's time), and the output it asked for. It stays in its
    unit's ledger until the attempt ends."""

    __slots__ = ("ahead", "attempt", "observed", "own_chars", "predicted_s", "prefill_chars",
                 "started_at", "tokens", "unit_id", "wait")  # fmt: skip

    def __init__(
        self,
        unit_id: str,
        attempt: Timed,
        ahead: float,
        prefill_chars: float,
        own_chars: float,
        wait: float,
        predicted_s: float,
        tokens: float,
    ):
        self.unit_id = unit_id
        self.attempt = attempt
        self.ahead = ahead
        self.prefill_chars = prefill_chars
        self.own_chars = own_chars
        self.wait = wait
        self.predicted_s = predicted_s
        self.tokens = tokens  # the output it asked for (max_tokens; a mean if it gave none)
        self.observed = False  # its TTFT went to the fit
        self.started_at = -1.0  # when its first token was seen (the policy's clock)


def slot_wait(left_s: list[float], unstarted: int, slots: int, turnover_s: float) -> float:
    """The wait for a batch slot of a request sent now to an engine of ``slots`` (0: not
    known, no wait reckoned) whose running requests have ``left_s`` s of output each to
    make, with ``unstarted`` requests before it that have no first token yet: they take
    the free slots first, then the k-th of them past those starts when the k-th running
    one ends; past the running ones, each waits ``turnover_s`` more (a slot's turnover).
    Sorts ``left_s``."""
    if slots <= 0:
        return 0.0
    behind = unstarted - max(0, slots - len(left_s))  # requests waiting ahead of this one
    if behind < 0:
        return 0.0
    left_s.sort()
    if behind < len(left_s):
        return left_s[behind]
    last = left_s[-1] if left_s else 0.0
    return last + (behind - len(left_s) + 1) * turnover_s


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

    def predict(self, unit_id: str, ahead: float, chars: float, wait: float = 0.0) -> float:
        """The unit's predicted TTFT in s (-1 when it is not warm), never below 0."""
        fit = self.units.get(unit_id)
        if fit is None or not fit.warm:
            return -1.0
        return max(0.0, fit.predict(ahead, chars * KCHARS, wait))

    def observe(
        self,
        unit_id: str,
        ahead: float,
        chars: float,
        ttft_s: float,
        wait: float = 0.0,
        own_chars: float = -1.0,
    ) -> None:
        """An attempt on the unit got its first token ``ttft_s`` after it was sent, with
        ``ahead`` requests there and ``chars`` prompt characters to prefill before its
        first token (``own_chars`` of them its own; -1: all), ``wait`` reckoned for a
        batch slot."""
        fit = self.of(unit_id)
        kchars = chars * KCHARS
        if fit.warm and ttft_s > 0.0 and self.on_error is not None:
            predicted = max(0.0, fit.predict(ahead, kchars, wait))
            self.on_error(abs(predicted - ttft_s) / ttft_s)
        fit.update(ahead, kchars, ttft_s, self._clock(), wait)
        own = kchars if own_chars < 0.0 else own_chars * KCHARS
        self.mean_kchars += 0.05 * (own - self.mean_kchars)

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

    def holds(
        self,
        unit_id: str,
        slo_ttft_s: float,
        slo_tpot_s: float,
        capacity: int,
        slots: int = 0,
        turnover: float = 1.0,
    ) -> float:
        """How many requests the unit can hold with a request of the fleet's mean prompt
        still predicted to start within ``slo_ttft_s`` and to stream within
        ``slo_tpot_s`` (0: no such objective): at most ``capacity``, and ``capacity``
        by an objective whose fit is not warm (nothing learnt says otherwise). Past the
        ``slots``, each request waiting adds ``turnover`` to the wait (a count: 1; in s:
        the time a slot takes to free, the mean request's decode over the slots)."""
        most = float(capacity)
        fit = self.units.get(unit_id)
        if fit is not None and fit.warm and slo_ttft_s > 0.0:
            a, b, c, q = fit.theta
            spare = slo_ttft_s - a - c * self.mean_kchars
            # n requests: n - 1 ahead of the one arriving; past the slots, q x turnover
            # each waiting
            n = _most(spare, b, 1.0)
            if slots > 0 and n > slots:
                qt = q * turnover
                n = _most(spare + b + qt * slots, b + qt, 0.0)
            most = min(most, n)
        fit = self.tpot.get(unit_id)
        if fit is not None and fit.warm and slo_tpot_s > 0.0:
            d, e = fit.theta[0], fit.theta[1]
            most = min(most, _most(slo_tpot_s - d, e, 0.0))  # batch = what it holds
        return most


def _most(spare: float, per_request: float, plus: float) -> float:
    """The requests that fit in ``spare`` s at ``per_request`` s each, plus ``plus``."""
    if spare < 0.0:
        return 0.0
    if per_request <= 0.0:
        return float("inf")
    return spare / per_request + plus
