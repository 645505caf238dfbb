"""Report figures (matplotlib, Agg backend). Each function returns a :class:`Figure`: PNG bytes
plus a title and a one-line caption that says what to read from it. Axes carry units.

Inputs are plain pandas DataFrames, so the same functions serve run, sweep and plan reports:

- per-request frames use ``requests.csv`` columns (seconds);
- per-step frames use ``timeseries.csv`` columns (vLLM Prometheus names);
- per-point frames use vLLM bench keys (``request_rate``, ``p99_ttft_ms``,
  ``output_throughput``, ...) plus a grouping column (arm or candidate).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

DPI = 100
SLO_STYLE = {"color": "#d62728", "linestyle": "--", "linewidth": 1.2}
KNEE_STYLE = {"color": "#7f7f7f", "linestyle": ":", "linewidth": 1.5}


@dataclass
class Figure:
    name: str  # file-safe, e.g. "latency_cdf"
    title: str
    caption: str  # one line: what to read from it
    png: bytes


def _finish(fig, name: str, title: str, caption: str, layout: bool = True) -> Figure:
    if layout:
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return Figure(name, title, caption, buf.getvalue())


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes,
            color="#888")


_LAT = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL"))


def latency_cdfs(req: pd.DataFrame, slo: dict | None = None) -> Figure:
    """Empirical CDFs of TTFT, TPOT and E2EL (ms) with SLO thresholds and the P99 marked."""
    slo = slo or {}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, _LAT):
        col = f"{key}_s"
        v = (pd.to_numeric(req[col], errors="coerce").to_numpy(float) * 1e3
             if col in req else np.array([]))
        v = np.sort(v[np.isfinite(v)])
        if len(v) == 0:
            _empty(ax, f"{label} values")
        else:
            y = np.arange(1, len(v) + 1) / len(v)
            if len(v) > 4000:  # large runs: plot 4000 quantiles, not every request
                idx = np.linspace(0, len(v) - 1, 4000).astype(int)
                v_plot, y = v[idx], y[idx]
            else:
                v_plot = v
            ax.step(v_plot, y, where="post", color="#1f77b4")
            p99 = float(np.percentile(v, 99))
            ax.axvline(p99, color="#1f77b4", linestyle=":", linewidth=1,
                       label=f"P99 {p99:.0f} ms")
            if v[0] > 0 and v[-1] / max(v[0], 1e-9) > 50:
                ax.set_xscale("log")
        thr = slo.get(f"{key}_ms")
        if thr:
            ax.axvline(thr, **SLO_STYLE, label=f"SLO {thr:g} ms")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    return _finish(fig, "latency_cdf", "Latency distributions",
                   "Read the height where each curve crosses the red dashed SLO line: that is "
                   "the fraction of requests meeting it (the dotted line is the P99).")


def latency_vs_rate(pts: pd.DataFrame, group: str, slo: dict | None = None,
                    knees: dict | None = None, percentiles: Sequence[int] = (50, 99)
                    ) -> Figure:
    """P50/P99 TTFT, TPOT, E2EL (ms) vs request rate (req/s), one line per group (mean over
    seeds), SLO lines dashed red, knees (capacity) dotted grey."""
    slo = slo or {}
    knees = knees or {}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    groups = list(dict.fromkeys(pts[group])) if len(pts) else []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label) in zip(axes, _LAT):
        any_line = False
        for gi, g in enumerate(groups):
            d = pts[pts[group] == g]
            for p, ls in zip(percentiles, ("--", "-", "-.")):
                col = f"p{p}_{key}_ms"
                if col not in d or not d[col].notna().any():
                    continue
                agg = d.groupby("request_rate")[col].mean().sort_index()
                ax.plot(agg.index, agg.values, ls, marker="o", ms=3,
                        color=colors[gi % len(colors)],
                        label=f"{g} P{p}" if len(groups) <= 4 else (g if p == 99 else None))
                any_line = True
            if g in knees and knees[g] and math.isfinite(knees[g]):
                ax.axvline(knees[g], color=colors[gi % len(colors)], linestyle=":",
                           linewidth=1)
        thr = slo.get(f"{key}_ms")
        if thr:
            ax.axhline(thr, **SLO_STYLE, label="SLO threshold")
        if not any_line:
            _empty(ax, f"{label} percentiles")
        elif ax.get_ylim()[1] / max(ax.get_ylim()[0], 1e-3) > 100:
            ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.grid(alpha=0.3)
    h, lab = axes[0].get_legend_handles_labels()
    if h:
        nrow = math.ceil(len(h) / 4)
        fig.legend(h, lab, loc="upper center", ncol=min(4, len(h)), fontsize=7,
                   bbox_to_anchor=(0.5, 1.0))
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.055 * nrow))
    else:
        fig.tight_layout()
    return _finish(fig, "latency_vs_rate", "Latency percentiles vs request rate",
                   "Read where each P99 line crosses the red SLO line: the rate there is the "
                   "most that configuration sustains; dotted verticals mark the found knees.",
                   layout=False)


def throughput_vs_rate(pts: pd.DataFrame, group: str, knees: dict | None = None) -> Figure:
    """Output throughput (tok/s) and request goodput vs offered request rate (req/s)."""
    knees = knees or {}
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = list(dict.fromkeys(pts[group])) if len(pts) else []
    for gi, g in enumerate(groups):
        d = pts[pts[group] == g]
        c = colors[gi % len(colors)]
        if "output_throughput" in d:
            a = d.groupby("request_rate")["output_throughput"].mean().sort_index()
            axes[0].plot(a.index, a.values, "-o", ms=3, color=c, label=str(g))
        if "request_throughput" in d:
            a = d.groupby("request_rate")["request_throughput"].mean().sort_index()
            axes[1].plot(a.index, a.values, "-", color=c, alpha=0.5, label=f"{g} throughput")
        if "request_goodput" in d and d["request_goodput"].notna().any():
            a = d.groupby("request_rate")["request_goodput"].mean().sort_index()
            axes[1].plot(a.index, a.values, "-o", ms=3, color=c, label=f"{g} goodput")
        k = knees.get(g)
        if k and math.isfinite(k):
            for ax in axes:
                ax.axvline(k, color=c, **{kk: v for kk, v in KNEE_STYLE.items()
                                          if kk != "color"})
    if len(pts):
        r = np.asarray(sorted(pts["request_rate"].unique()), dtype=float)
        axes[1].plot(r, r, color="#bbb", linewidth=1, label="offered = served")
    axes[0].set_ylabel("output throughput (tokens/s)")
    axes[1].set_ylabel("requests/s")
    for ax in axes:
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if not groups:
        _empty(axes[0], "points")
    return _finish(fig, "throughput_vs_rate", "Throughput and goodput vs request rate",
                   "Read where goodput (requests/s meeting every SLO) leaves the grey "
                   "offered = served diagonal: past that knee (dotted) extra load only adds "
                   "queueing.")


def _thin(ts: pd.DataFrame, n: int = 20000) -> pd.DataFrame:
    """Every k-th row so at most ~n are drawn (long runs sample every step)."""
    return ts.iloc[:: max(1, len(ts) // n)] if len(ts) > n else ts


def kv_timeline(ts: pd.DataFrame) -> Figure:
    """KV-cache usage (%) and running / waiting requests over simulated time (s)."""
    ts = _thin(ts)
    fig, axes = plt.subplots(2, 1, figsize=(12, 5), sharex=True)
    t = ts["time_s"] if "time_s" in ts else pd.Series(dtype=float)
    if "vllm:kv_cache_usage_perc" in ts:
        axes[0].plot(t, ts["vllm:kv_cache_usage_perc"] * 100, color="#9467bd", linewidth=0.8)
    else:
        _empty(axes[0], "KV-cache usage")
    axes[0].set_ylabel("KV-cache usage (%)")
    axes[0].set_ylim(0, 105)
    for col, c, lab in (("vllm:num_requests_running", "#2ca02c", "running"),
                        ("vllm:num_requests_waiting", "#ff7f0e", "waiting")):
        if col in ts:
            axes[1].plot(t, ts[col], color=c, linewidth=0.8, label=lab)
    axes[1].set_ylabel("requests")
    axes[1].set_xlabel("simulated time (s)")
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    return _finish(fig, "kv_timeline", "KV cache and queues over time",
                   "Read whether KV usage pins near 100% while requests wait: that is memory-"
                   "bound admission (and preemptions); a waiting queue with free KV means the "
                   "token budget or max_num_seqs limits.")


def instance_timeline(ts: pd.DataFrame, names: list[str]) -> Figure:
    """Cluster runs: per instance (``instance`` column of timeseries.csv), KV-cache usage (%)
    and requests in the engine (running + waiting) over simulated time (s)."""
    fig, axes = plt.subplots(2, 1, figsize=(12, 5), sharex=True)
    for k, g in ts.groupby("instance"):
        g = _thin(g, 5000)
        label = names[int(k)] if int(k) < len(names) else str(k)
        axes[0].plot(g["time_s"], g["vllm:kv_cache_usage_perc"] * 100, linewidth=0.7,
                     label=label)
        axes[1].plot(g["time_s"], g["vllm:num_requests_running"]
                     + g["vllm:num_requests_waiting"], linewidth=0.7, label=label)
    axes[0].set_ylabel("KV-cache usage (%)")
    axes[0].set_ylim(0, 105)
    axes[1].set_ylabel("requests in engine")
    axes[1].set_xlabel("simulated time (s)")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7, ncol=min(len(names), 6))
    for ax in axes:
        ax.grid(alpha=0.3)
    return _finish(fig, "instance_timeline", "Load and KV usage per instance",
                   "One line per instance: a router that balances well keeps the lines "
                   "together; prefix-aware routing trades some balance for cache hits.")


def step_timeline(ts: pd.DataFrame) -> Figure:
    """Engine step time (ms) and batch tokens per step over simulated time (s)."""
    ts = _thin(ts)
    fig, axes = plt.subplots(2, 1, figsize=(12, 5), sharex=True)
    t = ts["time_s"] if "time_s" in ts else pd.Series(dtype=float)
    if "step_seconds" in ts:
        axes[0].plot(t, ts["step_seconds"] * 1e3, color="#1f77b4", linewidth=0.6)
    else:
        _empty(axes[0], "step times")
    axes[0].set_ylabel("step time (ms)")
    if "step_tokens" in ts:
        axes[1].plot(t, ts["step_tokens"], color="#8c564b", linewidth=0.6, label="all tokens")
    if "num_prefill_tokens" in ts:
        axes[1].plot(t, ts["num_prefill_tokens"], color="#e377c2", linewidth=0.6,
                     alpha=0.7, label="prefill tokens")
    axes[1].set_ylabel("batch tokens per step")
    axes[1].set_xlabel("simulated time (s)")
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    return _finish(fig, "step_timeline", "Engine steps over time",
                   "Read step time against batch tokens: spikes line up with prefill chunks "
                   "(they stretch TPOT of the decodes sharing the step).")


def pareto_front(df: pd.DataFrame, label: str, x: str = "tokens_per_s_per_user",
                 y: str = "tokens_per_s_per_gpu", front: str = "pareto") -> Figure:
    """Tokens/s/GPU vs tokens/s/user (vLLM plot_pareto axes); the front is connected."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    d = df[[label, x, y] + ([front] if front in df else [])].dropna(subset=[x, y])
    if len(d) == 0:
        _empty(ax, "points with throughput")
    else:
        on = d[front].astype(bool) if front in d else pd.Series(False, index=d.index)
        ax.scatter(d.loc[~on, x], d.loc[~on, y], color="#aaa", label="dominated")
        f = d[on].sort_values(x)
        ax.plot(f[x], f[y], "-o", color="#d62728", label="Pareto front")
        for _, r in d.iterrows():
            ax.annotate(str(r[label]), (r[x], r[y]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens/s/user (output tokens/s per concurrent request)")
    ax.set_ylabel("tokens/s/GPU (output tokens/s per GPU)")
    ax.grid(alpha=0.3)
    return _finish(fig, "pareto", "Pareto frontier: per-GPU throughput vs per-user speed",
                   "Read up-and-right as better: red points are not beaten on both axes; "
                   "moving along the front trades per-GPU efficiency for interactivity.")


def cost_bars(df: pd.DataFrame, label: str = "candidate",
              recommended: str | None = None) -> Figure:
    """$/1M output tokens per candidate (bars), annotated with GPUs and $/h."""
    d = df.dropna(subset=["usd_per_1m_output_tokens"]).sort_values("usd_per_1m_output_tokens")
    fig, ax = plt.subplots(figsize=(9, 0.45 * max(3, len(d)) + 1.2))
    if len(d) == 0:
        _empty(ax, "candidates that meet the SLO")
    else:
        colors = ["#2ca02c" if r[label] == recommended else "#1f77b4" for _, r in d.iterrows()]
        ax.barh(d[label].astype(str), d["usd_per_1m_output_tokens"], color=colors)
        for i, (_, r) in enumerate(d.iterrows()):
            ax.text(r["usd_per_1m_output_tokens"], i,
                    f"  {int(r['gpus'])} GPUs, ${r['usd_per_hour']:.2f}/h", va="center",
                    fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, d["usd_per_1m_output_tokens"].max() * 1.45)
    ax.set_xlabel("cost ($ per 1M output tokens at the target rate)")
    ax.grid(axis="x", alpha=0.3)
    return _finish(fig, "cost", "Cost per candidate",
                   "Read the shortest bar (green = recommended): the cheapest deployment that "
                   "meets the SLO at the target rate; labels give its GPUs and $/h.")


def capacity_bars(df: pd.DataFrame, label: str = "candidate") -> Figure:
    """Per-replica capacity (req/s) with its 95% CI across seeds."""
    d = df.dropna(subset=["capacity_rps"])
    d = d[d["capacity_rps"] > 0].sort_values("capacity_rps", ascending=False)
    fig, ax = plt.subplots(figsize=(9, 0.45 * max(3, len(d)) + 1.2))
    if len(d) == 0:
        _empty(ax, "capacities")
    else:
        lo = (d["capacity_rps"] - d["ci_low"]).clip(lower=0)
        hi = (d["ci_high"] - d["capacity_rps"]).clip(lower=0)
        ax.barh(d[label].astype(str), d["capacity_rps"], xerr=[lo, hi], color="#17becf",
                capsize=3)
        ax.invert_yaxis()
    ax.set_xlabel("max sustainable request rate per replica meeting the SLO (req/s)")
    ax.grid(axis="x", alpha=0.3)
    return _finish(fig, "capacity", "Capacity per replica (knee) with 95% CI",
                   "Read bar length as how much traffic one replica takes within the SLO; "
                   "whiskers are the 95% confidence interval over seeds.")


def ab_deltas(df: pd.DataFrame) -> Figure:
    """Paired A/B deltas (%) with 95% CIs; one row per (comparison, metric, rate)."""
    fig, ax = plt.subplots(figsize=(9, 0.38 * max(3, len(df)) + 1.4))
    if len(df) == 0:
        _empty(ax, "A/B pairs")
    else:
        labels = [f"{r['comparison']} · {r['metric']} @ {r['request_rate']:g} req/s"
                  for _, r in df.iterrows()]
        y = np.arange(len(df))
        mid = df["delta_pct"].to_numpy(float)
        lo = mid - df["ci_low_pct"].to_numpy(float)
        hi = df["ci_high_pct"].to_numpy(float) - mid
        sig = df["significant"].astype(bool).to_numpy()
        ax.errorbar(mid, y, xerr=[np.nan_to_num(lo), np.nan_to_num(hi)], fmt="none",
                    ecolor="#555", capsize=3)
        ax.scatter(mid, y, c=np.where(sig, "#d62728", "#999"), zorder=3)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
    ax.set_xlabel("change of B vs A (%), 95% CI over paired seeds")
    ax.grid(axis="x", alpha=0.3)
    return _finish(fig, "ab_deltas", "A/B deltas",
                   "Read red dots (interval excludes 0) as real differences; for latencies "
                   "negative is better, for throughputs positive is better.")
