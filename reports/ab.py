"""Paired A/B statistics over sweep runs (common random numbers across arms).

Each arm B is compared with the baseline arm A at every request rate. Runs are paired by seed:
with common random numbers the arms of one seed saw the same request stream, so the per-seed
difference ``d_s = metric_B(s) - metric_A(s)`` removes the workload noise both share. Over the
``n`` seeds present (and finite) in both arms:

- ``diff`` = mean(d); t interval: ``diff ± t_{0.975, n-1} · sd(d) / sqrt(n)`` (scipy.stats.t),
  or a percentile bootstrap of mean(d) over resampled seeds (``method="bootstrap"``);
- ``rel_diff_pct`` = 100 · diff / mean(A) (and the interval scaled the same way);
- ``p_value``: two-sided paired t-test (informative; the verdict uses the interval);
- ``verdict``: "no significant difference" when the interval contains 0, else "B better" or
  "B worse" by the metric's direction (latency ``*_ms``: lower is better; throughput and
  goodput: higher is better); "insufficient data" with fewer than 2 pairs.

Every row is a separate test at the given confidence: with many metrics × rates × arms, expect
about 5% spurious "significant" rows at 95%; look for consistent patterns, or add seeds.
Functions take summary rows (list of dicts, or a pandas DataFrame) so reports can reuse them.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

DEFAULT_METRICS = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
    "output_throughput", "request_throughput", "total_token_throughput", "request_goodput",
)
# The short list printed by `simulate sweep` (ab.csv has every metric).
TABLE_METRICS = (
    "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms",
    "mean_e2el_ms", "output_throughput", "request_goodput",
)
AB_COLUMNS = (
    "request_rate", "metric", "arm_a", "arm_b", "n", "mean_a", "mean_b", "diff", "ci_low",
    "ci_high", "rel_diff_pct", "rel_ci_low_pct", "rel_ci_high_pct", "p_value", "method",
    "confidence", "verdict",
)
NO_DIFF = "no significant difference"
INSUFFICIENT = "insufficient data"


def metric_direction(name: str) -> int:
    """+1 if higher is better (throughput, goodput), -1 if lower is better (latencies, failures)."""
    if name.endswith("_ms") or name in ("failed", "duration", "num_preemptions"):
        return -1
    if "throughput" in name or "goodput" in name or name in ("completed",):
        return 1
    return -1


def _records(rows: Any) -> list[dict]:
    if hasattr(rows, "to_dict"):  # pandas DataFrame
        return [dict(r) for r in rows.to_dict("records")]
    return [dict(r) for r in rows]


def _num(v: Any) -> float:
    if v is None or v == "":
        return math.nan
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _rate_key(v: Any) -> Any:
    x = _num(v)
    return v if math.isnan(x) else x


def mean_ci(d: Sequence[float], *, method: str = "t", confidence: float = 0.95,
            n_boot: int = 10000, rng_seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of the paired differences ``d``."""
    d = np.asarray(d, dtype=float)
    n = len(d)
    m = float(d.mean()) if n else math.nan
    if n < 2:
        return m, math.nan, math.nan
    if method == "t":
        from scipy import stats

        se = float(d.std(ddof=1)) / math.sqrt(n)
        if se == 0.0:
            return m, m, m
        h = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
        return m, m - h, m + h
    if method == "bootstrap":
        rng = np.random.default_rng(rng_seed)
        means = d[rng.integers(0, n, size=(n_boot, n))].mean(axis=1)
        a = (1 - confidence) / 2
        lo, hi = np.quantile(means, [a, 1 - a])
        return m, float(lo), float(hi)
    raise ValueError(f"method {method!r}: expected 't' or 'bootstrap'")


def _p_value(d: np.ndarray) -> float:
    if len(d) < 2:
        return math.nan
    sd = float(d.std(ddof=1))
    if sd == 0.0:
        return 1.0 if float(d.mean()) == 0.0 else 0.0
    from scipy import stats

    t = float(d.mean()) / (sd / math.sqrt(len(d)))
    return float(2 * stats.t.sf(abs(t), len(d) - 1))


def verdict(metric: str, lo: float, hi: float, n: int) -> str:
    """"B better" / "B worse" when the interval excludes 0, else "no significant difference"."""
    if n < 2 or math.isnan(lo) or math.isnan(hi):
        return INSUFFICIENT
    if lo <= 0.0 <= hi:
        return NO_DIFF
    better = (hi < 0) == (metric_direction(metric) < 0)
    return "B better" if better else "B worse"


def paired_ab(
    rows: Any,
    *,
    baseline: str | None = None,
    metrics: Iterable[str] | None = None,
    method: str = "t",
    confidence: float = 0.95,
    n_boot: int = 10000,
    rng_seed: int = 0,
    arm_key: str = "arm",
    rate_key: str = "request_rate",
    seed_key: str = "seed",
) -> list[dict]:
    """Paired comparison of every arm against ``baseline`` (default: the first arm seen),
    per request rate and metric. Metrics absent (or all null) in the rows are skipped."""
    recs = _records(rows)
    if not recs:
        return []
    arms: list[str] = []
    rates: list[Any] = []
    table: dict[tuple, dict] = {}
    for r in recs:
        arm, rate = str(r[arm_key]), _rate_key(r.get(rate_key))
        if arm not in arms:
            arms.append(arm)
        if rate not in rates:
            rates.append(rate)
        table[(arm, rate, r[seed_key])] = r
    base = baseline if baseline is not None else arms[0]
    if base not in arms:
        raise ValueError(f"baseline arm {base!r} not in {arms}")
    metrics = list(metrics) if metrics is not None else list(DEFAULT_METRICS)
    present = [m for m in metrics if any(not math.isnan(_num(r.get(m))) for r in recs)]
    out = []
    for rate in sorted(rates, key=lambda x: (isinstance(x, str), x if not isinstance(x, str)
                                              else 0, str(x))):
        for arm in arms:
            if arm == base:
                continue
            seeds = sorted({s for (a, rt, s) in table if a == base and rt == rate}
                           & {s for (a, rt, s) in table if a == arm and rt == rate}, key=str)
            for m in present:
                a = np.array([_num(table[(base, rate, s)].get(m)) for s in seeds], dtype=float)
                b = np.array([_num(table[(arm, rate, s)].get(m)) for s in seeds], dtype=float)
                ok = np.isfinite(a) & np.isfinite(b)
                a, b = a[ok], b[ok]
                d = b - a
                mean, lo, hi = mean_ci(d, method=method, confidence=confidence, n_boot=n_boot,
                                       rng_seed=rng_seed)
                ma = float(a.mean()) if len(a) else math.nan
                mb = float(b.mean()) if len(b) else math.nan
                scale = 100.0 / ma if ma not in (0.0,) and not math.isnan(ma) else math.nan
                out.append({
                    "request_rate": rate, "metric": m, "arm_a": base, "arm_b": arm,
                    "n": len(d), "mean_a": ma, "mean_b": mb, "diff": mean,
                    "ci_low": lo, "ci_high": hi, "rel_diff_pct": mean * scale,
                    "rel_ci_low_pct": lo * scale, "rel_ci_high_pct": hi * scale,
                    "p_value": _p_value(d), "method": method, "confidence": confidence,
                    "verdict": verdict(m, lo, hi, len(d)),
                })
    return out


def ab_csv_text(ab_rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(AB_COLUMNS)
    for r in ab_rows:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in AB_COLUMNS])
    return buf.getvalue()


def _fmt(x: float, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


_SHORT = {"output_throughput": "out tok/s", "request_throughput": "req/s",
          "total_token_throughput": "tok/s", "request_goodput": "goodput"}


def _short(metric: str) -> str:
    """``p99_ttft_ms`` → ``ttft p99``; throughputs abbreviated."""
    if metric in _SHORT:
        return _SHORT[metric]
    stat, _, rest = metric.removesuffix("_ms").partition("_")
    return f"{rest} {stat}" if rest else metric


def ab_rich_table(ab_rows: list[dict], metrics: Iterable[str] | None = TABLE_METRICS,
                  title: str | None = None):
    """A compact rich Table of the A/B rows (restricted to ``metrics`` when given): per rate,
    arm and metric, A's mean, the relative difference B - A with its interval, the verdict
    ("n.s." = no significant difference)."""
    from rich import box
    from rich.table import Table

    keep = set(metrics) if metrics is not None else None
    conf = ab_rows[0]["confidence"] if ab_rows else 0.95
    base = ab_rows[0]["arm_a"] if ab_rows else "A"
    t = Table(title=title or f"A/B vs {base} (A): paired B - A over seeds",
              caption=f"{conf:.0%} CI; n.s. = no significant difference; latencies in ms",
              box=box.SIMPLE_HEAD)
    for col, just in (("rate", "right"), ("B", "left"), ("metric", "left"), ("A mean", "right"),
                      (f"B-A % [{conf:.0%} CI]", "right"), ("verdict", "left")):
        t.add_column(col, justify=just, no_wrap=col != "B")
    style = {"B better": "green", "B worse": "red"}
    prev = None
    for r in ab_rows:
        if keep is not None and r["metric"] not in keep:
            continue
        group = (r["request_rate"], r["arm_b"])
        if prev is not None and group != prev:
            t.add_section()
        prev = group
        rel = r["rel_diff_pct"]
        if math.isnan(rel):
            rel_s = "-"
        elif math.isnan(r["rel_ci_low_pct"]):
            rel_s = f"{rel:+.1f}"
        else:
            rel_s = f"{rel:+.1f} [{r['rel_ci_low_pct']:+.1f}, {r['rel_ci_high_pct']:+.1f}]"
        rate = r["request_rate"]
        v = r["verdict"]
        shown = {NO_DIFF: "n.s.", INSUFFICIENT: "n<2"}.get(v, v)
        ma = r["mean_a"]
        t.add_row(f"{rate:g}" if isinstance(rate, float) else str(rate), r["arm_b"],
                  _short(r["metric"]), _fmt(ma, 0 if abs(ma) >= 100 else 1),
                  rel_s, f"[{style[v]}]{shown}[/]" if v in style else shown)
    return t
