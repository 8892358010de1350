"""The worker's per-step token budget: how many prompt tokens a step may prefill beside its decodes.

Without a budget (the default) a step prefills every prompt it admits whole, so one long
prompt stalls every stream of the worker for the length of its prefill. With one, a step
counts one token per decoded sequence plus the prompt tokens it prefills, and an engine that
takes prefill chunks (`takes_prefill_chunks`) gets a long prompt in pieces over several
steps beside the decodes (cadence.worker.batch_scheduler does the cutting):

- `FixedBudget` (--max-step-tokens N): N tokens a step.
- `TargetBudget` (--itl-target-ms T): as many prefill tokens as the worker's own step-time
  model (`StepTimeModel`, fit online from every step it runs) predicts keep the step within T.

Either way a step with prefill to do prefills at least `MIN_PREFILL_CHUNK` tokens, however
many decodes it has (decodes are never held back), so a prompt always progresses.
"""

from __future__ import annotations

import logging
import time

from cadence.config import EngineConfig
from cadence.wording import counted

log = logging.getLogger("cadence.budget")

MIN_PREFILL_CHUNK = 16
"""Prompt tokens a step prefills at least when it has any to do (one torch KV block)."""

MAX_PREFILL_TOKENS = 16384
"""Prompt tokens one step prefills at most under --itl-target-ms, whatever the model says
(a step model fit on small chunks must not plan an unbounded one)."""

STARTUP_PREFILL = 64
"""Prefill tokens of the first step under --itl-target-ms, before anything is measured."""


class FixedBudget:
    """--max-step-tokens N: decodes + prefill tokens <= N (prefill at least min(N, 16))."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self._floor = min(MIN_PREFILL_CHUNK, tokens)

    def prefill_tokens(self, decodes: int) -> int:
        """Prompt tokens the next step may prefill beside `decodes` decoded sequences."""
        return max(self._floor, self.tokens - decodes)

    def observe(self, decodes: int, prefill: int, seconds: float) -> None:
        """A fixed budget learns nothing from the steps."""

    def describe(self) -> str:
        return f"--max-step-tokens {self.tokens}: decodes + prefill tokens <= {self.tokens} a step"


class StepTimeModel:
    """seconds ~= fixed + per_decode * decodes + per_prefill_token * prefill tokens.

    Fit by exponentially weighted least squares over the steps run so far (each step's
    weight decays by `DECAY` a step: a memory of about 200 steps, so the model follows a card
    that warms up or contexts that grow), with two safeguards that plain least squares lacks:
    every coefficient is kept >= 0 (one that comes out negative is fixed at 0 and the rest
    refit), and a small ridge pulls each coefficient toward its previous value, so a
    direction the recent steps do not excite (say, no prefill for a while, or always the same
    batch) keeps what was learnt instead of drifting on noise.
    """

    DECAY = 0.995
    RIDGE = 1e-3
    """Relative weight of the previous fit against the steps' evidence, per coefficient."""

    __slots__ = ("_s", "_r", "steps", "prefill_steps", "coef")

    def __init__(self) -> None:
        # Weighted sums of x x^T (x = 1, decodes, prefill) as its six distinct entries
        # (11, 1d, 1p, dd, dp, pp), and of x * seconds.
        self._s = [0.0] * 6
        self._r = [0.0] * 3
        self.steps = 0
        self.prefill_steps = 0
        self.coef = (0.0, 0.0, 0.0)
        """(fixed, per_decode, per_prefill_token) in seconds; zeros until the first fit."""

    def observe(self, decodes: int, prefill: int, seconds: float) -> None:
        """Add one step (its composition and measured duration) and refit."""
        lam = self.DECAY
        s, r = self._s, self._r
        d, p = float(decodes), float(prefill)
        s[0] = s[0] * lam + 1.0
        s[1] = s[1] * lam + d
        s[2] = s[2] * lam + p
        s[3] = s[3] * lam + d * d
        s[4] = s[4] * lam + d * p
        s[5] = s[5] * lam + p * p
        r[0] = r[0] * lam + seconds
        r[1] = r[1] * lam + d * seconds
        r[2] = r[2] * lam + p * seconds
        self.steps += 1
        if prefill:
            self.prefill_steps += 1
        self.coef = self._fit()

    def predict(self, decodes: int, prefill: int) -> float:
        fixed, per_decode, per_prefill = self.coef
        return fixed + per_decode * decodes + per_prefill * prefill

    @property
    def prefill_spread(self) -> float:
        """Weighted standard deviation of the steps' prefill tokens: how well the data pins
        the per-token cost (0 when every step prefilled the same)."""
        s = self._s
        mean = s[2] / s[0]
        return max(0.0, s[5] / s[0] - mean * mean) ** 0.5

    def _fit(self) -> tuple[float, float, float]:
        s, r, prev = self._s, self._r, self.coef
        full = ((s[0], s[1], s[2]), (s[1], s[3], s[4]), (s[2], s[4], s[5]))
        active = [0, 1, 2]
        while True:
            n = len(active)
            a = [[full[i][j] for j in active] for i in active]
            b = [r[i] for i in active]
            for k, i in enumerate(active):
                weight = self.RIDGE * full[i][i] + 1e-12
                a[k][k] += weight
                b[k] += weight * prev[i]
            x = _solve(a, b, n)
            negative = [active[k] for k in range(n) if x[k] < 0.0]
            if not negative:
                coef = [0.0, 0.0, 0.0]
                for k, i in enumerate(active):
                    coef[i] = x[k]
                return coef[0], coef[1], coef[2]
            active = [i for i in active if i not in negative]
            if not active:
                return 0.0, 0.0, 0.0


def _solve(a: list[list[float]], b: list[float], n: int) -> list[float]:
    """x with a x = b for n <= 3 (Gaussian elimination with partial pivoting)."""
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if a[pivot][col] == 0.0:
            return [0.0] * n
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for row in range(col + 1, n):
            f = a[row][col] / a[col][col]
            for k in range(col, n):
                a[row][k] -= f * a[col][k]
            b[row] -= f * b[col]
    x = [0.0] * n
    for row in range(n - 1, -1, -1):
        x[row] = (b[row] - sum(a[row][k] * x[k] for k in range(row + 1, n))) / a[row][row]
    return x


class TargetBudget:
    """--itl-target-ms T: the prefill tokens the step-time model says fit in T.

    The rule, each step with prefill to do, `decodes` being its decoded sequences:

        prefill = clamp((T - fixed - per_decode * decodes) / per_prefill_token,
                        MIN_PREFILL_CHUNK, min(ceiling, MAX_PREFILL_TOKENS))

    Until the model is trusted (`fitted`: at least 8 steps measured, 3 of them with prefill,
    their prefill sizes spread by at least MIN_PREFILL_CHUNK / 4 and a positive per-token
    cost) the fraction is not used and the step prefills `ceiling` tokens: STARTUP_PREFILL at
    first, doubled after each step with prefill that stayed within T, halved (down to
    MIN_PREFILL_CHUNK) after one that did not: a slow start that measures as it grows.
    Once fitted, `ceiling` only grows (2x the largest prefill of a step that stayed within
    T), so the model is never asked to extrapolate past twice what it has seen.
    """

    def __init__(self, target_ms: float, worker: int = 0) -> None:
        self.target_s = target_ms / 1e3
        self.model = StepTimeModel()
        self.ceiling = STARTUP_PREFILL
        self.fitted = False
        self._worker = worker
        self._logged_budget = 0
        self._logged_at = 0.0

    def prefill_tokens(self, decodes: int) -> int:
        """Prompt tokens the next step may prefill beside `decodes` decoded sequences."""
        limit = min(self.ceiling, MAX_PREFILL_TOKENS)
        if not self.fitted:
            return limit
        fixed, per_decode, per_prefill = self.model.coef
        room = (self.target_s - fixed - per_decode * decodes) / per_prefill
        return int(max(MIN_PREFILL_CHUNK, min(room, limit)))

    def observe(self, decodes: int, prefill: int, seconds: float) -> None:
        """Learn from one step: refit the model, move the ceiling, log a material change."""
        model = self.model
        model.observe(decodes, prefill, seconds)
        if prefill:
            if seconds <= self.target_s:
                self.ceiling = max(self.ceiling, 2 * prefill)
            elif not self.fitted:
                self.ceiling = max(MIN_PREFILL_CHUNK, prefill // 2)
        if not self.fitted:
            self.fitted = (
                model.steps >= 8
                and model.prefill_steps >= 3
                and model.prefill_spread >= MIN_PREFILL_CHUNK / 4
                and model.coef[2] > 0.0
            )
            if not self.fitted:
                return
        budget = decodes + self.prefill_tokens(decodes)
        logged = self._logged_budget
        if abs(budget - logged) * 4 > logged:  # a change of 25% or more
            now = time.monotonic()
            if now - self._logged_at >= 5.0 or not logged:
                self._logged_budget, self._logged_at = budget, now
                log.info(
                    "worker %d: step budget %s (%s + %d prefill) for --itl-target-ms %g; "
                    "step model %s",
                    self._worker,
                    counted(budget, "token"),
                    counted(decodes, "decode"),
                    budget - decodes,
                    self.target_s * 1e3,
                    self.describe_model(),
                )

    def describe_model(self) -> str:
        fixed, per_decode, per_prefill = self.model.coef
        return (
            f"{fixed * 1e3:.2f} ms + {per_decode * 1e3:.4f} ms/decode + "
            f"{per_prefill * 1e3:.4f} ms/prefill token"
        )

    def describe(self) -> str:
        return f"--itl-target-ms {self.target_s * 1e3:g}: prefill fit to the measured step time"


StepBudget = FixedBudget | TargetBudget


def budget_for(config: EngineConfig, worker: int = 0) -> StepBudget | None:
    """The budget the server's flags ask for, or None (no budget: whole prompts, as always)."""
    if config.max_step_tokens > 0:
        return FixedBudget(config.max_step_tokens)
    if config.itl_target_ms > 0:
        return TargetBudget(config.itl_target_ms, worker)
    return None
