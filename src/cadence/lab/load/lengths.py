"""How long prompts and outputs are: `--prompt-tokens` and `--max-tokens` as a distribution.

- `N`: fixed; `LO:HI`: uniform in [LO, HI] (the shape's own bounds, `RequestShape`);
- `normal:MEAN,SD`: a normal distribution;
- `lognormal:MEAN,SD`: a log-normal one whose lengths have that mean and standard deviation
  (the long right tail of real prompts and answers);
- `empirical:FILE`: drawn from the lengths in FILE, one whole number a line (a column of
  production lengths), each equally likely.

A normal or log-normal draw is rounded and kept within [MIN, MAX] when the text ends in
`,MIN,MAX` (default 1 and 1,000,000): no length is below one token.
"""

from __future__ import annotations

import math
import random

import msgspec

KINDS = ("normal", "lognormal", "empirical")


class Lengths(msgspec.Struct, frozen=True, kw_only=True):
    """A distribution of lengths (see the module's docstring)."""

    kind: str
    mean: float = 0.0
    sd: float = 0.0
    low: int = 1
    high: int = 1_000_000
    values: list[int] = []
    """The empirical distribution's lengths."""
    text: str = ""
    """As given on the command line (for the result's workload)."""

    def draw(self, rng: random.Random) -> int:
        if self.kind == "empirical":
            return self.values[rng.randrange(len(self.values))]
        if self.kind == "normal":
            value = rng.gauss(self.mean, self.sd)
        else:
            sigma2 = math.log1p((self.sd / self.mean) ** 2)
            value = rng.lognormvariate(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2))
        return min(self.high, max(self.low, round(value)))

    @property
    def said(self) -> str:
        """As the result's workload record says it: as given, else its kind."""
        return self.text or self.kind

    @property
    def bounds(self) -> tuple[int, int]:
        """The least and the most length it can draw."""
        if self.kind == "empirical":
            return min(self.values), max(self.values)
        return self.low, self.high


def token_lengths(text: str) -> tuple[int, int] | Lengths:
    """`N` (fixed) or `LO:HI` (uniform, inclusive): (LO, HI); or a distribution: its Lengths.
    ValueError saying what to fix."""
    if text.partition(":")[0] in KINDS:
        return parse_lengths(text)
    lo, _, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"expected N or LO:HI, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"expected 1 <= LO <= HI, got {text!r}")
    return bounds


def parse_lengths(text: str) -> Lengths:
    """`normal:MEAN,SD[,MIN,MAX]`, `lognormal:MEAN,SD[,MIN,MAX]` or `empirical:FILE`;
    ValueError saying what to fix."""
    kind, _, rest = text.partition(":")
    if kind == "empirical":
        try:
            with open(rest) as f:
                values = [int(line) for line in f if line.strip()]
        except OSError as exc:
            raise ValueError(f"cannot read {rest}: {exc.strerror or exc}") from None
        except ValueError:
            raise ValueError(f"{rest}: expected one whole number a line") from None
        if not values or min(values) < 1:
            raise ValueError(f"{rest}: expected lengths of 1 or more, one a line")
        return Lengths(kind=kind, values=values, text=text)
    try:
        numbers = [float(part) for part in rest.split(",")]
    except ValueError:
        numbers = []
    if kind not in KINDS or len(numbers) not in (2, 4):
        raise ValueError(
            f"expected N, LO:HI, normal:MEAN,SD, lognormal:MEAN,SD (each with "
            f"an optional ,MIN,MAX) or empirical:FILE, got {text!r}"
        )
    mean, sd, *clip = numbers
    low, high = (int(clip[0]), int(clip[1])) if clip else (1, 1_000_000)
    if not (mean > 0 and sd >= 0 and 1 <= low <= high):
        raise ValueError(f"expected MEAN > 0, SD >= 0 and 1 <= MIN <= MAX, got {text!r}")
    return Lengths(kind=kind, mean=mean, sd=sd, low=low, high=high, text=text)
