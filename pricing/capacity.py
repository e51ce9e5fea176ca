"""Capacity projections: what one replica of a SKU produces and earns in a month.

From a measured aggregate output throughput (tokens/s while the replica is busy, from a
benchmark's results file, worker telemetry, or the ledger itself) and the GPU's hourly cost:
- GPU-hours per 1M output tokens = GPUs x 1M / (tok/s x 3600)       (while busy)
- output tokens per period       = tok/s x busy fraction x days x 86,400
- cost per 1M output tokens      = GPU cost of the whole period / tokens of the period
  (idle time is paid for too, so this rises as the busy fraction falls)
- revenue per 1M output tokens   = output price + the input that comes with them
  (input tokens per output token, a share of it cached) at the plan's prices
- margin = revenue - cost, per 1M and per period; break-even busy fraction.
Reference check: 387.6 tok/s at 70% busy -> ~703M tokens / 30 days, 0.717 GPU-h per 1M.

A GPU-hour cost that nobody gave (None) is unknown, never 0: the cost, margin and break-even
figures are None and `unknown` says why; the token figures stand.

All arithmetic is Decimal; what-if inputs are fields of `CapacityInputs` (`dataclasses.replace`).

Size: Capacity projection as one chain of pure functions: measurements in, a per-SKU model, the
30-day projection out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_DOWN, ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any

from pricing.invoices import LedgerRow
from pricing.money import TOKENS_PER_PRICING_UNIT, round_to_minor, to_decimal
from pricing.periods import utc
from pricing.plans import PricePlan, TokenClass

SECONDS_PER_HOUR = 3600
HOURS_PER_DAY = 24
_MILLION = Decimal(TOKENS_PER_PRICING_UNIT)
_RATIO = Decimal("0.0001")  # per-1M figures and fractions are reported to 4 decimals


def _q4(value: Decimal) -> Decimal:
    return value.quantize(_RATIO, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True)
class Throughput:
    """Measured aggregate output tokens per second of one replica while busy."""

    sku_id: str
    output_tokens_per_second: Decimal
    gpus: int = 1  # GPUs one replica occupies
    source: str = ""  # where the number came from: "bench:<file>", "ledger:<worker>", ...
    input_tokens_per_output_token: Decimal | None = None  # the measured request mix, if known

    def __post_init__(self) -> None:
        if self.output_tokens_per_second <= 0 or self.gpus < 1:
            raise ValueError(f"throughput of {self.sku_id} must be positive on >= 1 GPU")


@dataclass(frozen=True)
class CapacityInputs:
    """The what-if knobs."""

    gpu_hour_cost: Decimal | None  # per GPU, in `currency`; None: unknown
    currency: str = "USD"
    busy_fraction: Decimal = Decimal("0.70")
    days: int = 30
    # Prices per 1M tokens (None: take them from a plan, or project cost only).
    output_price: Decimal | None = None
    input_price: Decimal | None = None
    cached_input_price: Decimal | None = None
    # The input that comes with each output token (None: the measured mix, else 0).
    input_tokens_per_output_token: Decimal | None = None
    cached_share_of_input: Decimal = Decimal(0)
    # Why the GPU-hour cost is unknown, when it is (reported with the projection).
    unknown_cost_reason: str = "no GPU-hour cost given"

    def __post_init__(self) -> None:
        if not Decimal(0) < self.busy_fraction <= Decimal(1):
            raise ValueError(f"busy fraction must be in (0, 1], got {self.busy_fraction}")
        if not Decimal(0) <= self.cached_share_of_input <= Decimal(1):
            raise ValueError(f"cached share must be in [0, 1], got {self.cached_share_of_input}")
        if self.days <= 0 or (
            self.gpu_hour_cost is not None and to_decimal(self.gpu_hour_cost) < 0
        ):
            raise ValueError("days must be positive and the GPU cost non-negative")

    def priced_by(self, plan: PricePlan) -> CapacityInputs:
        """These inputs with the plan's prices (explicit prices here win)."""
        from dataclasses import replace

        return replace(
            self,
            currency=plan.currency,
            output_price=self.output_price
            if self.output_price is not None
            else plan.output_per_mtok,
            input_price=self.input_price if self.input_price is not None else plan.input_per_mtok,
            cached_input_price=(
                self.cached_input_price
                if self.cached_input_price is not None
                else plan.unit_price(TokenClass.cached_input)
            ),
        )


@dataclass(frozen=True)
class CapacityProjection:
    sku_id: str
    source: str
    output_tokens_per_second: Decimal
    gpus: int
    busy_fraction: Decimal
    days: int
    currency: str
    gpu_hours_per_million_output: Decimal
    output_tokens_per_period: int
    cost_per_period: Decimal | None  # None: the GPU-hour cost is unknown
    cost_per_million_output: Decimal | None
    revenue_per_million_output: Decimal | None
    revenue_per_period: Decimal | None
    margin_per_million_output: Decimal | None
    margin_per_period: Decimal | None
    margin_fraction: Decimal | None  # margin / revenue
    breakeven_busy_fraction: Decimal | None  # busy fraction at which revenue covers cost
    unknown: dict[str, str] = field(default_factory=dict)  # input -> why it is unknown

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: decimals as strings."""
        return {
            k: (str(v) if isinstance(v, Decimal) else dict(v) if isinstance(v, dict) else v)
            for k, v in self.__dict__.items()
        }


def project(throughput: Throughput, inputs: CapacityInputs) -> CapacityProjection:
    tps = throughput.output_tokens_per_second
    period_hours = Decimal(inputs.days * HOURS_PER_DAY)
    busy_seconds = inputs.busy_fraction * period_hours * SECONDS_PER_HOUR
    tokens_exact = tps * busy_seconds
    tokens = int(tokens_exact.to_integral_value(rounding=ROUND_DOWN))
    gpu_hours_per_million = throughput.gpus * _MILLION / (tps * SECONDS_PER_HOUR)
    unknown: dict[str, str] = {}
    period_cost = cost_per_million = None
    if inputs.gpu_hour_cost is None:
        unknown["gpu_hour_cost"] = inputs.unknown_cost_reason
    else:
        period_cost = inputs.gpu_hour_cost * throughput.gpus * period_hours
        cost_per_million = period_cost / tokens_exact * _MILLION

    revenue_per_million: Decimal | None = None
    if inputs.output_price is not None:
        ratio = inputs.input_tokens_per_output_token
        if ratio is None:
            ratio = throughput.input_tokens_per_output_token or Decimal(0)
        cached = ratio * inputs.cached_share_of_input
        input_price = inputs.input_price or Decimal(0)
        # As invoices bill it: cached input with no price of its own earns the input price.
        cached_price = (
            inputs.cached_input_price if inputs.cached_input_price is not None else input_price
        )
        revenue_per_million = (
            inputs.output_price + (ratio - cached) * input_price + cached * cached_price
        )
    revenue = margin_million = margin = margin_fraction = breakeven = None
    if revenue_per_million is not None:
        revenue = tokens_exact / _MILLION * revenue_per_million
    if revenue_per_million is not None and revenue is not None and period_cost is not None:
        assert cost_per_million is not None
        margin_million = revenue_per_million - cost_per_million
        margin = revenue - period_cost
        margin_fraction = _q4(margin / revenue) if revenue else None
        full_revenue = revenue / inputs.busy_fraction  # revenue at 100% busy
        breakeven = _q4(period_cost / full_revenue) if full_revenue else None

    def money(value: Decimal | None) -> Decimal | None:
        return None if value is None else round_to_minor(value, inputs.currency)

    return CapacityProjection(
        sku_id=throughput.sku_id,
        source=throughput.source,
        output_tokens_per_second=tps,
        gpus=throughput.gpus,
        busy_fraction=inputs.busy_fraction,
        days=inputs.days,
        currency=inputs.currency,
        gpu_hours_per_million_output=_q4(gpu_hours_per_million),
        output_tokens_per_period=tokens,
        cost_per_period=money(period_cost),
        cost_per_million_output=None if cost_per_million is None else _q4(cost_per_million),
        revenue_per_million_output=None
        if revenue_per_million is None
        else _q4(revenue_per_million),
        revenue_per_period=money(revenue),
        margin_per_million_output=None if margin_million is None else _q4(margin_million),
        margin_per_period=money(margin),
        margin_fraction=margin_fraction,
        breakeven_busy_fraction=breakeven,
        unknown=unknown,
    )


# Where measured throughput comes from ----------------------------------------------------

# Key names a benchmark results file may use for aggregate output tokens per second.
_THROUGHPUT_KEYS = (
    "output_tokens_per_second",
    "output_tok_per_s",
    "output_tok_s",
    "aggregate_output_tok_s",
    "aggregate_output_tokens_per_second",
    "tok_per_s",
    "tok_s",
)


def _find_throughput(doc: Mapping[str, Any]) -> Any:
    for key in _THROUGHPUT_KEYS:
        if key in doc:
            return doc[key]
    for nested in ("summary", "results", "result", "aggregate"):
        value = doc.get(nested)
        if isinstance(value, Mapping):
            found = _find_throughput(value)
            if found is not None:
                return found
    return None


def throughput_from_bench(
    doc: Mapping[str, Any] | str | Path, sku_id: str | None = None
) -> Throughput:
    """Throughput from a benchmark results JSON (a file path or the parsed document).

    Reads the aggregate output tokens/s (one of `_THROUGHPUT_KEYS`, at top level or under
    summary/results), `gpus` (default 1), `sku_id` (or the argument), and, when present,
    `prompt_tokens` / `output_tokens` (or `max_tokens`) for the input-per-output mix."""
    if isinstance(doc, Mapping):
        source, results = "bench", doc
    else:
        source, results = f"bench:{Path(doc).name}", json.loads(Path(doc).read_text())
    value = _find_throughput(results)
    if value is None:
        raise ValueError(
            f"no output throughput in the results (looked for {', '.join(_THROUGHPUT_KEYS)})"
        )
    sku = sku_id or results.get("sku_id") or results.get("sku") or results.get("model")
    if not sku:
        raise ValueError("the results name no SKU; pass sku_id")
    mix = None
    prompt, output = (
        results.get("prompt_tokens"),
        results.get("output_tokens", results.get("max_tokens")),
    )
    if isinstance(prompt, int | float) and isinstance(output, int | float) and output > 0:
        mix = Decimal(str(prompt)) / Decimal(str(output))
    # Decimal(str(x)): the value as printed in the file, not the binary float's expansion.
    return Throughput(
        sku_id=str(sku),
        output_tokens_per_second=Decimal(str(value)),
        gpus=int(results.get("gpus", 1)),
        source=source,
        input_tokens_per_output_token=mix,
    )


@dataclass(frozen=True)
class BenchPoint:
    """One measured load point of a benchmark results file: aggregate output tok/s at a
    concurrency, with the latency it came with."""

    sku_id: str
    variant: str  # what was measured: "engine" (gpu_suite), "gateway" / "direct" (gpu_endpoint)
    output_tokens_per_second: Decimal
    concurrency: int | None = None
    ttft_p95_s: Decimal | None = None
    e2e_p95_s: Decimal | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # max tokens per request
    gpus: int = 1
    source: str = ""

    def throughput(self) -> Throughput:
        mix = None
        if self.prompt_tokens is not None and self.output_tokens:
            mix = Decimal(self.prompt_tokens) / Decimal(self.output_tokens)
        at = f" c={self.concurrency}" if self.concurrency is not None else ""
        return Throughput(
            sku_id=self.sku_id,
            output_tokens_per_second=self.output_tokens_per_second,
            gpus=self.gpus,
            source=f"{self.source} {self.variant}{at}".strip(),
            input_tokens_per_output_token=mix,
        )


def _number(value: Any) -> Decimal | None:
    # Decimal(str(x)): the value as printed in the file, not the binary float's expansion.
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float | str):
        try:
            result = Decimal(str(value))
        except ArithmeticError:
            return None
        return result if result.is_finite() else None
    return None


def _int(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number == number.to_integral_value() else None


def _model_name(value: Any) -> str:
    # gpu_suite writes "qwen3.6-27b (random weights)": the SKU-like part is the first word.
    return str(value).split(" (")[0].strip() if value else ""


def _positive_throughput(figures: Any, key: str) -> Decimal | None:
    """The output tokens/s under `key` of a benchmark's figures, if they are a mapping and it
    is a positive number."""
    if not isinstance(figures, Mapping):
        return None
    tps = _number(figures.get(key))
    return tps if tps is not None and tps > 0 else None


def bench_points(
    doc: Mapping[str, Any] | str | Path, sku_id: str | None = None
) -> list[BenchPoint]:
    """Every load point of a benchmark results file (a path or the parsed document):
    - bench/engine/suite.py: `load_point` (concurrency, prompt_len, max_tokens) and one point per
      engine section with `output_tok_s` (fp8, bf16, hf), SKU `<model>-<section>`, and one per
      concurrency of a sweep section (`sweep_fp8` -> SKU `<model>-fp8`);
    - bench/endpoint/governed.py: `config` (preset, quantize, concurrency, prompt_tokens,
      max_tokens) and the `gateway` and `direct` figures, at the load point and at each
      concurrency of its `sweep`, SKU `<preset>-<quantize>`;
    - otherwise one point from the aggregate output tokens/s (one of `_THROUGHPUT_KEYS`, at
      top level or under summary/results) with `sku_id`, `concurrency`, `prompt_tokens`,
      `output_tokens` / `max_tokens`; or a `points` list of such documents.
    `sku_id` names the SKU of a file that names none. Raises ValueError if nothing is found."""
    if isinstance(doc, Mapping):
        source, results = "bench", doc
    else:
        source, results = f"bench:{Path(doc).name}", json.loads(Path(doc).read_text())
    points: list[BenchPoint] = []
    if isinstance(results.get("sections"), Mapping):
        load = results.get("load_point") or {}
        base = _model_name(results.get("model")) or sku_id or "model"
        # (SKU, concurrency, figures): each engine section at the load point, and each
        # measured concurrency of a sweep section (sweep_fp8 -> SKU <model>-fp8)
        engine_rows: list[tuple[str, Any, Any]] = []
        for section, figures in results["sections"].items():
            sweep = figures.get("points") if isinstance(figures, Mapping) else None
            if section.startswith("sweep_") and isinstance(sweep, list):
                name = f"{base}-{section.removeprefix('sweep_')}"
                engine_rows += [
                    (name, r.get("concurrency"), r) for r in sweep if isinstance(r, Mapping)
                ]
            else:
                engine_rows.append((f"{base}-{section}", load.get("concurrency"), figures))
        for name, concurrency, figures in engine_rows:
            tps = _positive_throughput(figures, "output_tok_s")
            if tps is None:  # not an engine section, or a point the budget skipped
                continue
            points.append(
                BenchPoint(
                    sku_id=name,
                    variant="engine",
                    output_tokens_per_second=tps,
                    concurrency=_int(concurrency),
                    ttft_p95_s=_number(figures.get("ttft_p95_s")),
                    e2e_p95_s=_number(figures.get("e2e_p95_s")),
                    prompt_tokens=_int(load.get("prompt_len")),
                    output_tokens=_int(load.get("max_tokens")),
                    source=source,
                )
            )
    elif isinstance(results.get("config"), Mapping) and any(
        isinstance(results.get(k), Mapping) for k in ("gateway", "direct")
    ):
        config = results["config"]
        preset = str(config.get("preset") or sku_id or "model")
        quantize = config.get("quantize")
        sku = f"{preset}-{quantize}" if quantize and quantize != "None" else preset
        # The load point, then each concurrency of a sweep (`gpu_endpoint --sweep`).
        rows = [(results, _int(config.get("concurrency")))]
        sweep = results.get("sweep")
        if isinstance(sweep, list):
            rows += [(r, _int(r.get("concurrency"))) for r in sweep if isinstance(r, Mapping)]
        for (row, concurrency), variant in ((r, v) for r in rows for v in ("gateway", "direct")):
            measured: Any = row.get(variant)
            tps = _positive_throughput(measured, "output_tokens_per_s")
            if tps is None:
                continue
            points.append(
                BenchPoint(
                    sku_id=sku,
                    variant=variant,
                    output_tokens_per_second=tps,
                    concurrency=concurrency,
                    ttft_p95_s=_number(measured.get("ttft_s_p95")),
                    e2e_p95_s=_number(measured.get("e2e_s_p95")),
                    prompt_tokens=_int(config.get("prompt_tokens")),
                    output_tokens=_int(config.get("max_tokens")),
                    source=source,
                )
            )
    else:
        listed = results.get("points")
        docs: list[Any] = list(listed) if isinstance(listed, list) else [results]
        for item in docs:
            if not isinstance(item, Mapping):
                continue
            tps = _number(_find_throughput(item))
            if tps is None or tps <= 0:
                continue
            named: Any = item.get("sku_id") or item.get("sku") or item.get("model")
            named = named or results.get("sku_id") or results.get("sku") or sku_id
            if not named:
                raise ValueError("the results name no SKU; pass sku_id")
            points.append(
                BenchPoint(
                    sku_id=str(named),
                    variant=str(item.get("variant", "")),
                    output_tokens_per_second=tps,
                    concurrency=_int(item.get("concurrency")),
                    ttft_p95_s=_number(item.get("ttft_p95_s", item.get("ttft_s_p95"))),
                    e2e_p95_s=_number(item.get("e2e_p95_s", item.get("e2e_s_p95"))),
                    prompt_tokens=_int(item.get("prompt_tokens")),
                    output_tokens=_int(item.get("output_tokens", item.get("max_tokens"))),
                    gpus=_int(item.get("gpus")) or 1,
                    source=source,
                )
            )
    if not points:
        raise ValueError(
            f"no output throughput in {source} (read gpu_suite sections, gpu_endpoint "
            f"gateway/direct figures, or one of {', '.join(_THROUGHPUT_KEYS)})"
        )
    return points


class NoPointMeetsTheChoice(ValueError):
    """No measured load point matches the concurrency / SLO asked for."""


def choose_points(
    points: Iterable[BenchPoint],
    *,
    concurrency: int | None = None,
    ttft_p95_max_s: Decimal | None = None,
    e2e_p95_max_s: Decimal | None = None,
    variants: Iterable[str] = (),
    sku_ids: Iterable[str] = (),
) -> list[BenchPoint]:
    """Per (SKU, variant), the highest-throughput point measured at `concurrency` (if given)
    whose p95 latencies are within the SLO (a point without the figure does not qualify).
    Raises NoPointMeetsTheChoice, saying what was measured."""
    every = list(points)
    wanted_variants, wanted_skus = set(variants), set(sku_ids)
    kept = [
        p
        for p in every
        if (not wanted_variants or p.variant in wanted_variants)
        and (not wanted_skus or p.sku_id in wanted_skus)
        and (concurrency is None or p.concurrency == concurrency)
        and (
            ttft_p95_max_s is None or (p.ttft_p95_s is not None and p.ttft_p95_s <= ttft_p95_max_s)
        )
        and (e2e_p95_max_s is None or (p.e2e_p95_s is not None and p.e2e_p95_s <= e2e_p95_max_s))
    ]
    if not kept:
        measured = sorted(
            {
                f"{p.sku_id} {p.variant} at concurrency {p.concurrency}: "
                f"ttft p95 {p.ttft_p95_s} s, e2e p95 {p.e2e_p95_s} s"
                for p in every
            }
        )
        raise NoPointMeetsTheChoice(
            "no measured point matches the chosen concurrency/SLO; measured: " + "; ".join(measured)
        )
    best: dict[tuple[str, str], BenchPoint] = {}
    for p in kept:
        key = (p.sku_id, p.variant)
        if key not in best or p.output_tokens_per_second > best[key].output_tokens_per_second:
            best[key] = p
    return [best[k] for k in sorted(best)]


def throughput_from_ledger(rows: Iterable[LedgerRow], sku_id: str) -> list[Throughput]:
    """Per worker of the SKU: output tokens / busy seconds, busy = the union of its requests'
    [started_at, finished_at] intervals (so concurrency counts once), with the request mix.
    (`BillingStore.worker_busy` computes the same per worker in SQL, over a window of the
    ledger too large to hold.)"""
    by_worker: dict[str, list[LedgerRow]] = {}
    for row in rows:
        if row.sku_id == sku_id:
            by_worker.setdefault(row.worker_id or "?", []).append(row)
    return throughput_from_busy(
        sku_id,
        [
            WorkerBusy(
                worker_id,
                _busy_seconds((utc(r.started_at), utc(r.finished_at)) for r in worker_rows),
                sum(r.completion_tokens for r in worker_rows),
                sum(r.prompt_tokens for r in worker_rows),
            )
            for worker_id, worker_rows in by_worker.items()
        ],
    )


@dataclass(frozen=True)
class WorkerBusy:
    """One worker's requests in a window: the seconds it was busy (the union of their
    intervals) and the tokens they read and wrote."""

    worker_id: str
    busy_seconds: Decimal
    completion_tokens: int
    prompt_tokens: int


def throughput_from_busy(sku_id: str, workers: Iterable[WorkerBusy]) -> list[Throughput]:
    """The throughput of each worker that was busy and wrote something, by worker id."""
    measured: list[Throughput] = []
    for w in sorted(workers, key=lambda w: w.worker_id):
        if w.busy_seconds <= 0 or w.completion_tokens <= 0:
            continue
        output = Decimal(w.completion_tokens)
        measured.append(
            Throughput(
                sku_id=sku_id,
                output_tokens_per_second=_q4(output / w.busy_seconds),
                source=f"ledger:{w.worker_id}",
                input_tokens_per_output_token=_q4(Decimal(w.prompt_tokens) / output),
            )
        )
    return measured


def _busy_seconds(intervals: Iterable[tuple[datetime, datetime]]) -> Decimal:
    total = Decimal(0)
    current: tuple[datetime, datetime] | None = None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current is not None:
                total += _seconds(current[1] - current[0])
            current = (start, end)
        elif end > current[1]:
            current = (current[0], end)
    if current is not None:
        total += _seconds(current[1] - current[0])
    return total


def _seconds(delta: Any) -> Decimal:
    return Decimal(delta.days * 86400 + delta.seconds) + Decimal(delta.microseconds) / 1_000_000
