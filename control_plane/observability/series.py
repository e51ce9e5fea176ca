"""A short in-memory time series per SKU for the operator's page: latency percentiles,
throughput, prefix-cache hits and load in fixed steps over the last few minutes.

Prometheus keeps the long history; this exists so the page can draw charts with nothing else
running. The open step keeps raw samples; a step that closes is reduced to its summary, so
memory stays bounded by the number of steps, not by the traffic.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# Percentiles the page shows for each latency kind.
QUANTILES = (0.5, 0.9, 0.99)
LATENCIES = ("ttft", "itl", "e2e")

# Column names of one SKU's series, in the order the JSON lists them.
COLUMNS = (
    "requests",
    "prompt_tps",
    "generation_tps",
    # Prompt tokens looked up in the prefix cache / found there, per step (vLLM's
    # prefix_cache_queries / prefix_cache_hits), and their ratio (None without prompt tokens).
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_hit_rate",
    *(f"{kind}_p{round(q * 100)}" for kind in LATENCIES for q in QUANTILES),
    "kv_usage",
    "kv_usage_max",
    "running",
    "waiting",
)

# Columns an idle step reads as 0 (traffic); the others read as unknown (None).
ZERO_WHEN_IDLE = (
    "requests",
    "prompt_tps",
    "generation_tps",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class _Step:
    """One step of one SKU: raw samples while open, a summary once closed."""

    index: int
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in LATENCIES})
    # Load as the heartbeats last reported it during this step (None: no live worker seen).
    kv_usage: float | None = None
    kv_usage_max: float | None = None
    running: int | None = None
    waiting: int | None = None
    summary: dict[str, float | int | None] | None = None

    def summarize(self, step_s: float) -> dict[str, float | int | None]:
        if self.summary is not None:
            return self.summary
        row: dict[str, float | int | None] = {
            "requests": self.requests,
            "prompt_tps": self.prompt_tokens / step_s,
            "generation_tps": self.generation_tokens / step_s,
            "prefix_cache_queries": self.prompt_tokens,
            "prefix_cache_hits": self.cached_tokens,
            "prefix_cache_hit_rate": (
                self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None
            ),
        }
        for kind, values in self.samples.items():
            ordered = sorted(values)
            for q in QUANTILES:
                row[f"{kind}_p{round(q * 100)}"] = percentile(ordered, q)
        row.update(
            kv_usage=self.kv_usage,
            kv_usage_max=self.kv_usage_max,
            running=self.running,
            waiting=self.waiting,
        )
        return row

    def close(self, step_s: float) -> None:
        self.summary = self.summarize(step_s)
        self.samples = {}


class SkuSeries:
    """Steps of `step_s` seconds over the last `window_s` seconds, for one SKU."""

    def __init__(self, step_s: float, window_s: float) -> None:
        self.step_s = step_s
        self.max_steps = max(1, math.ceil(window_s / step_s))
        self.steps: deque[_Step] = deque()

    def _step(self, now: float) -> _Step:
        index = int(now // self.step_s)
        if self.steps and self.steps[-1].index == index:
            return self.steps[-1]
        if self.steps:
            self.steps[-1].close(self.step_s)
        step = _Step(index)
        self.steps.append(step)
        self._prune(index)
        return step

    def _prune(self, current: int) -> None:
        while self.steps and self.steps[0].index <= current - self.max_steps:
            self.steps.popleft()

    def add_request(
        self,
        now: float,
        *,
        ttft_s: float | None,
        itl_s: Iterable[float],
        e2e_s: float | None,
        prompt_tokens: int,
        generation_tokens: int,
        cached_tokens: int = 0,
    ) -> None:
        step = self._step(now)
        step.requests += 1
        step.prompt_tokens += prompt_tokens
        step.cached_tokens += cached_tokens
        step.generation_tokens += generation_tokens
        if ttft_s is not None:
            step.samples["ttft"].append(ttft_s)
        step.samples["itl"].extend(itl_s)
        if e2e_s is not None:
            step.samples["e2e"].append(e2e_s)

    def set_load(
        self, now: float, *, kv_usage: float, kv_usage_max: float, running: int, waiting: int
    ) -> None:
        step = self._step(now)
        step.kv_usage = kv_usage
        step.kv_usage_max = (
            kv_usage_max if step.kv_usage_max is None else max(step.kv_usage_max, kv_usage_max)
        )
        step.running = running
        step.waiting = waiting

    def columns(
        self, now: float, start_index: int, end_index: int
    ) -> dict[str, list[float | int | None]]:
        """Columns for steps start_index..end_index inclusive; steps with no data read as zero
        traffic and unknown latency/load."""
        self._prune(int(now // self.step_s))
        rows = {step.index: step.summarize(self.step_s) for step in self.steps}
        out: dict[str, list[float | int | None]] = {name: [] for name in COLUMNS}
        for index in range(start_index, end_index + 1):
            row = rows.get(index)
            for name in COLUMNS:
                if row is not None:
                    out[name].append(row[name])
                else:
                    out[name].append(0 if name in ZERO_WHEN_IDLE else None)
        return out
