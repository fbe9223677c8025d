"""Samples of durations, their percentiles, and the budgets that bound how many are taken.

Percentiles are nearest-rank, so every figure in a table is a duration that was observed, and
a p99 over fewer than 100 samples is simply the largest one (the table shows each count).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

NS_PER_MS = 1_000_000


@dataclass
class Samples:
    """Durations in nanoseconds (``time.perf_counter_ns`` differences)."""

    values_ns: list[int] = field(default_factory=list)

    def add(self, ns: int) -> None:
        self.values_ns.append(ns)

    @property
    def count(self) -> int:
        return len(self.values_ns)

    def percentile_ms(self, q: float) -> float:
        """Nearest-rank percentile ``q`` (0 to 100) in ms; NaN when there are no samples."""
        if not self.values_ns:
            return math.nan
        ordered = sorted(self.values_ns)
        rank = max(1, math.ceil(q / 100.0 * len(ordered)))
        return ordered[rank - 1] / NS_PER_MS

    @property
    def p50(self) -> float:
        return self.percentile_ms(50)

    @property
    def p95(self) -> float:
        return self.percentile_ms(95)

    @property
    def p99(self) -> float:
        return self.percentile_ms(99)

    @property
    def mean(self) -> float:
        if not self.values_ns:
            return math.nan
        return sum(self.values_ns) / len(self.values_ns) / NS_PER_MS


@dataclass
class Budget:
    """At most ``max_count`` samples, and no more once ``max_s`` has passed (but ``min_count``).

    Slow contenders (a pebble disposable call takes ~100 ms) get fewer samples, so that every
    section ends in bounded time; the tables say how many samples each row rests on.
    """

    max_count: int
    max_s: float
    min_count: int = 20
    started_ns: int = field(default_factory=time.perf_counter_ns)

    def more(self, done: int) -> bool:
        if done >= self.max_count:
            return False
        if done < self.min_count:
            return True
        return time.perf_counter_ns() - self.started_ns < self.max_s * 1e9


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when either is missing or the denominator is zero."""
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator


def paired_median_ratio_ci(
    blocks: list[tuple[list[int], list[int]]], *, resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval of median(a) / median(b), resampling whole blocks (a, b).

    Each block was measured at one moment of the machine, both sides alike; resampling blocks
    rather than single calls keeps what moves together together. An interval that straddles
    a bar says the run could not tell, which on a shared machine is an answer too.
    """
    if not blocks:
        return math.nan, math.nan
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picked = rng.choices(blocks, k=len(blocks))
        a = sorted(v for block in picked for v in block[0])
        b = sorted(v for block in picked for v in block[1])
        if a and b:
            ratios.append(a[(len(a) - 1) // 2] / b[(len(b) - 1) // 2])
    if not ratios:
        return math.nan, math.nan
    ratios.sort()
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]
