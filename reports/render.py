"""``simulate report DIR``: Markdown + self-contained HTML reports for a run, a sweep or a plan.

- run dir (``result.json`` + ``requests.csv`` + ``timeseries.csv``): latency CDFs with SLO
  lines, KV cache / queues over time, step time / batch tokens over time;
- sweep dir (``vllm bench sweep`` layout ``<exp>/SERVE-<arm>-BENCH-<x>/run=<seed>.json``,
  optionally ``summary.csv``): latency percentiles, throughput and goodput vs rate, Pareto
  front, paired A/B deltas;
- plan dir (``plan.json`` / ``plan.csv`` of ``simulate plan``): cost and capacity per
  candidate, Pareto front, latency and throughput vs rate with the knees.

The first paragraph states the answer. ``report.md`` references PNG files written next to it;
``report.html`` embeds the same PNGs as base64 (no scripts, no external resources: it opens
offline).
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from servesim.reports.numbers import human
from servesim.simulator.errors import ServesimError, one_line, short_repr

# ---------------------------------------------------------------------------------------------
# Report model + writers


@dataclass
class Table:
    df: pd.DataFrame
    caption: str = ""


@dataclass
class Section:
    heading: str
    items: list = field(default_factory=list)  # str (paragraph) | Table | figures.Figure


@dataclass
class Report:
    title: str
    summary: str
    sections: list[Section] = field(default_factory=list)
    kind: str = ""

    @property
    def figures(self) -> list:
        from servesim.reports.figures import Figure

        return [it for s in self.sections for it in s.items if isinstance(it, Figure)]


def _cell(v: Any) -> str:
    """A table cell for people (``reports.numbers.human``): 12,660 not 1.266e+04."""
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if v is None or isinstance(v, (int, float, np.integer, np.floating)):
        return human(v, digits=4)
    return str(v)


def md_table(df: pd.DataFrame) -> str:
    cols = [str(c) for c in df.columns]
    esc = lambda s: s.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(esc(c) for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(esc(_cell(v)) for v in row) + " |")
    return "\n".join(lines)


def html_table(df: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
        for row in df.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def to_markdown(rep: Report, outdir: Path) -> str:
    """Markdown text; writes each figure as ``fig_<name>.png`` into ``outdir``."""
    from servesim.reports.figures import Figure
    from servesim.reports.writers import atomic_write_text

    out = [f"# {rep.title}", "", rep.summary, ""]
    for sec in rep.sections:
        out += [f"## {sec.heading}", ""]
        for it in sec.items:
            if isinstance(it, Figure):
                fn = f"fig_{it.name}.png"
                atomic_write_text(outdir / fn, it.png)
                out += [f"![{it.title}]({fn})", "", f"*{it.title}.* {it.caption}", ""]
            elif isinstance(it, Table):
                if it.caption:
                    out += [it.caption, ""]
                out += [md_table(it.df), ""]
            else:
                out += [str(it), ""]
    return "\n".join(out).rstrip() + "\n"


_CSS = """body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1180px;
margin:24px auto;padding:0 16px;color:#222;line-height:1.45}h1{font-size:1.6em}
h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:1.6em}
.answer{background:#f3f8f3;border-left:4px solid #2ca02c;padding:10px 14px;font-size:1.05em}
table{border-collapse:collapse;font-size:12px;margin:8px 0;display:block;overflow-x:auto}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#f4f4f4}figure{margin:12px 0}img{max-width:100%;border:1px solid #eee}
figcaption{font-size:13px;color:#444}.muted{color:#777;font-size:12px}"""


def to_html(rep: Report) -> str:
    """One self-contained HTML page (inline CSS, base64 PNGs, no scripts)."""
    from servesim.reports.figures import Figure

    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(rep.title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(rep.title)}</h1>",
             f'<p class="answer">{_inline_md(rep.summary)}</p>']
    for sec in rep.sections:
        parts.append(f"<h2>{html.escape(sec.heading)}</h2>")
        for it in sec.items:
            if isinstance(it, Figure):
                b64 = base64.b64encode(it.png).decode()
                parts.append(
                    f'<figure><img alt="{html.escape(it.title)}" '
                    f'src="data:image/png;base64,{b64}"><figcaption><b>'
                    f"{html.escape(it.title)}.</b> {html.escape(it.caption)}</figcaption>"
                    "</figure>")
            elif isinstance(it, Table):
                if it.caption:
                    parts.append(f"<p>{_inline_md(it.caption)}</p>")
                parts.append(html_table(it.df))
            else:
                parts.append(f"<p>{_inline_md(str(it))}</p>")
    parts.append('<p class="muted">Generated by servesim (simulated results).</p>')
    parts.append("</body></html>")
    return "\n".join(parts)


def _inline_md(s: str) -> str:
    s = html.escape(s)
    s = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", s)
    s = re.sub(r"`(.+?)`", r"<code>\1</code>", s)
    return s


# ---------------------------------------------------------------------------------------------
# Detection + entry point


def detect_kind(d: Path) -> str:
    """``plan`` | ``run`` | ``sweep`` for a results folder (ServesimError otherwise)."""
    if (d / "plan.json").is_file() or (d / "plan.csv").is_file():
        return "plan"
    if (d / "result.json").is_file() and (d / "requests.csv").is_file():
        return "run"
    if (d / "summary.csv").is_file() or next(d.glob("**/run=*.json"), None) is not None:
        return "sweep"
    raise ServesimError(
        f"{d}: not a results folder (expected result.json + requests.csv, a sweep with "
        "summary.csv or SERVE-*/run=*.json, or a plan with plan.json/plan.csv)")


def build_report(d: str | Path) -> Report:
    d = Path(d)
    if not d.is_dir():
        raise ServesimError(f"{d}: no such directory")
    kind = detect_kind(d)
    from servesim.reports.plan import plan_report

    rep = {"plan": plan_report, "run": run_report, "sweep": sweep_report}[kind](d)
    rep.kind = kind
    return rep


def write_report(d: str | Path) -> tuple[Path, Path]:
    """Write ``report.md`` (+ ``fig_*.png``) and ``report.html`` into ``d``.

    Every output path is checked before anything is written (ServesimError naming the first
    that cannot be: a directory in the way, a read-only folder), and report.md and
    report.html are both written to temp files before either replaces the old one, so a
    failing report leaves the previous pair as it was."""
    import os
    import tempfile

    d = Path(d)
    rep = build_report(d)
    md, hp = d / "report.md", d / "report.html"
    for p in (md, hp, *(d / f"fig_{f.name}.png" for f in rep.figures)):
        if p.is_dir() or (p.exists() and not p.is_file()):
            raise ServesimError(f"{p}: is a directory (or not a regular file); cannot write "
                                "the report there")
    if not os.access(d, os.W_OK):
        raise ServesimError(f"{d}: folder is not writable; cannot write the report there")
    temps: list[str] = []
    try:
        for text in (to_markdown(rep, d), to_html(rep)):  # (markdown writes the figures)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".report.", suffix=".tmp")
            temps.append(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8"))
            os.chmod(tmp, 0o644)  # mkstemp creates 0600
        for tmp, p in zip(temps, (md, hp)):
            os.replace(tmp, p)
    except OSError as e:
        raise ServesimError(f"{d}: cannot write the report ({one_line(e)})") from None
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return md, hp


# ---------------------------------------------------------------------------------------------
# Run report


def load_json(p: Path) -> dict:
    """A results JSON object (ServesimError naming the file when it cannot be read or is not
    an object)."""
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ServesimError(f"{p}: cannot read JSON ({one_line(e)})") from None
    if not isinstance(data, dict):
        raise ServesimError(f"{p}: expected a JSON object at the top level, got "
                            f"{type(data).__name__}")
    return data


def read_csv(p: Path, **kw) -> pd.DataFrame:
    """A results CSV file (ServesimError naming the file when it cannot be parsed)."""
    try:
        return pd.read_csv(p, **kw)
    except pd.errors.EmptyDataError:
        raise ServesimError(f"{p}: empty CSV file (no header row)") from None
    except (OSError, ValueError) as e:  # ParserError and UnicodeDecodeError are ValueErrors
        raise ServesimError(f"{p}: cannot read CSV ({one_line(e)})") from None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
        v, (bool, np.bool_))


def check_numbers(values: dict, keys, where: Path | str, allow_inf_text: bool = False) -> None:
    """ServesimError naming ``where`` and the key when one of ``keys`` in ``values`` is set
    but is not a number (``allow_inf_text``: vLLM's ``"inf"`` request rate is one)."""
    for k in keys:
        v = values.get(k)
        if v is None or _is_number(v) or (allow_inf_text and v == "inf"):
            continue
        raise ServesimError(f"{where}: {k}: expected a number, got {short_repr(v)}")


def _slo_of_run(d: Path, result: dict) -> dict:
    slo: dict = {}
    cfgp = d / "config.resolved.yaml"
    if cfgp.is_file():
        import yaml

        try:
            tree = yaml.safe_load(cfgp.read_text()) or {}
        except (yaml.YAMLError, OSError, ValueError):  # unreadable: a report without SLOs
            tree = {}
        if not isinstance(tree, dict):
            raise ServesimError(f"{cfgp}: expected a mapping of config sections at the top "
                                f"level, got {type(tree).__name__}")
        sec = tree.get("slo") or {}
        if not isinstance(sec, dict):
            raise ServesimError(f"{cfgp}: slo: expected a mapping such as {{ttft_ms: 2000}}, "
                                f"got {short_repr(sec)}")
        slo = {k: v for k, v in sec.items() if v is not None}
        check_numbers(slo, list(slo), f"{cfgp}: slo")
    for k in ("ttft", "tpot", "e2el"):  # extras some writers add
        v = result.get(f"slo_{k}_ms")
        if v is not None:
            slo.setdefault(f"{k}_ms", v)
    return slo


def _fmt(v: Any, unit: str = "", nd: int = 0) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "n/a"
    if not math.isfinite(f):
        return "n/a"
    return f"{f:,.{nd}f}{unit}"


def run_report(d: Path) -> Report:
    from servesim.reports import figures as F

    res = load_json(d / "result.json")
    check_numbers(res, _RUN_NUMBER_KEYS, d / "result.json")
    if not isinstance(res.get("cluster_instances") or [], list) or not all(
            isinstance(i, dict) for i in res.get("cluster_instances") or []):
        raise ServesimError(f"{d / 'result.json'}: cluster_instances: expected a list of "
                            f"objects, got {short_repr(res['cluster_instances'])}")
    req = read_csv(d / "requests.csv")
    ts = read_csv(d / "timeseries.csv") if (d / "timeseries.csv").is_file() else pd.DataFrame()
    slo = _slo_of_run(d, res)

    comp = res.get("completed", int((req.get("finished_reason") == "stop").sum())
                   if "finished_reason" in req else len(req))
    failed = res.get("failed", 0)
    preempt = (int(pd.to_numeric(req["num_preemptions"], errors="coerce").fillna(0).sum())
               if "num_preemptions" in req else res.get("num_preemptions", 0))
    lat = []
    verdicts = []
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL")):
        p50, p99 = res.get(f"median_{key}_ms"), res.get(f"p99_{key}_ms")
        if p99 is None and f"{key}_s" in req:
            a = pd.to_numeric(req[f"{key}_s"], errors="coerce").dropna().to_numpy() * 1e3
            if len(a):
                p50, p99 = float(np.median(a)), float(np.percentile(a, 99))
        if p99 is None:
            continue
        s = f"{label} P50 {_fmt(p50, ' ms')} / P99 {_fmt(p99, ' ms')}"
        thr = slo.get(f"{key}_ms")
        if thr and not math.isfinite(float(p99)):
            s += f" (SLO {thr:g} ms: no data)"
        elif thr:
            ok = float(p99) <= thr
            s += f" (SLO {thr:g} ms: {'met' if ok else 'MISSED'})"
            verdicts.append(ok)
        lat.append(s)
    kvmax = (pd.to_numeric(ts["vllm:kv_cache_usage_perc"], errors="coerce").max() * 100
             if "vllm:kv_cache_usage_perc" in ts and len(ts) else math.nan)
    summary = (
        f"**{_fmt(comp)} requests completed ({_fmt(failed)} failed) in "
        f"{_fmt(res.get('duration'), ' s', 1)}: {_fmt(res.get('request_throughput'), ' req/s', 2)}"
        f", {_fmt(res.get('output_throughput'), ' output tok/s')}"
        f" ({_fmt(res.get('total_token_throughput'), ' total tok/s')})** at an offered "
        f"{res.get('request_rate', 'n/a')} req/s. " + "; ".join(lat) + ". ")
    if verdicts:
        summary += ("All P99 SLOs are met. " if all(verdicts)
                    else "At least one P99 SLO is missed. ")
    if res.get("request_goodput") is not None and res.get("request_throughput"):
        summary += (f"Goodput {_fmt(res['request_goodput'], ' req/s', 2)} "
                    f"({_fmt(100 * res['request_goodput'] / res['request_throughput'], '%')} "
                    "of throughput). ")
    summary += f"{preempt} preemptions; peak KV-cache usage {_fmt(kvmax, '%')}."

    keys = [k for k in ("request_rate", "num_prompts", "completed", "failed", "duration",
                        "request_throughput", "request_goodput", "output_throughput",
                        "total_token_throughput", "max_concurrent_requests", "mean_ttft_ms",
                        "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                        "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
                        "p99_e2el_ms", "num_gpu_blocks", "gpu", "num_gpus") if k in res]
    tbl = pd.DataFrame({"metric": keys, "value": [res[k] for k in keys]})
    secs = [Section("Headline metrics (vLLM bench schema)", [Table(tbl)]),
            Section("Latency", [F.latency_cdfs(req, slo)])]
    if res.get("cluster_instances"):  # cluster runs (simulator/cluster/)
        secs.append(_cluster_section(res, ts))
    if len(ts):
        secs.append(Section("KV cache and queues", [F.kv_timeline(ts)]))
        secs.append(Section("Engine steps", [F.step_timeline(ts)]))
    title = f"servesim run report: {res.get('model_id', d.name)}"
    return Report(title, summary, secs)


# result.json keys the run report reads as numbers
_RUN_NUMBER_KEYS = ("completed", "failed", "num_preemptions", "duration", "request_throughput",
                    "request_goodput", "output_throughput", "total_token_throughput",
                    *(f"{s}_{k}_ms" for s in ("median", "p99") for k in ("ttft", "tpot", "e2el")),
                    *(f"slo_{k}_ms" for k in ("ttft", "tpot", "e2el")))


def _cluster_section(res: dict, ts: pd.DataFrame) -> Section:
    """The router's distribution and per-instance load (cluster runs)."""
    from servesim.reports import figures as F

    insts = res["cluster_instances"]
    totals: dict = {}
    for i in insts:  # shares within a role (P/D: prefill and decode routes apart)
        totals[i.get("role")] = totals.get(i.get("role"), 0) + (i.get("requests_routed") or 0)
    cols = ("name", "role", "gpu", "requests_routed", "gpu_busy_frac",
            "mean_kv_cache_usage_perc", "prefix_cache_hit_rate", "cpu_prefix_cache_hit_rate",
            "num_preemptions")
    tbl = pd.DataFrame([{c: i.get(c) for c in cols if c in i or c == "name"} for i in insts])
    tbl.insert(4, "share", [100.0 * (i.get("requests_routed") or 0)
                            / (totals[i.get("role")] or 1) for i in insts])
    text = f"Router: {res.get('cluster_router')}"
    if res.get("cluster_decode_router"):
        text += (f"; decode router: {res['cluster_decode_router']}; KV link "
                 f"{res.get('kv_transfer_link', {}).get('kind')}: mean transfer "
                 f"{_fmt(res.get('mean_kv_transfer_ms'), ' ms', 2)}, P99 "
                 f"{_fmt(res.get('p99_kv_transfer_ms'), ' ms', 2)}")
    items: list = [text + ". Requests routed per instance (share %), busy fraction of "
                   "simulated time, mean KV usage, hit rates per tier.", Table(tbl)]
    if "instance" in ts and len(ts):
        items.append(F.instance_timeline(ts, [i["name"] for i in insts]))
    return Section("Cluster: router distribution and instances", items)


# ---------------------------------------------------------------------------------------------
# Sweep report


_RUN_RE = re.compile(r"run=(\d+)\.json$")


def load_sweep_points(d: Path) -> pd.DataFrame:
    """One row per run (vLLM bench keys + ``arm``, ``run``, ``experiment``).

    Prefers the sweep's ``summary.csv`` (``d/summary.csv`` or ``d/*/summary.csv``: arms in the
    sweep file's order); otherwise reads every ``SERVE-<arm>-BENCH-<x>/run=<i>.json``."""
    summaries = [d / "summary.csv"] if (d / "summary.csv").is_file() else sorted(
        d.glob("*/summary.csv"))
    frames = []
    for sp in summaries:
        f = read_csv(sp)
        for c in f.columns:
            if _sweep_number_key(c):
                f[c] = _numeric_column(f[c], sp)
        if "arm" not in f:
            f["arm"] = f.get("label", "all")
        f["run"] = f["seed"] if "seed" in f else f.get("run_number", 0)
        f["experiment"] = sp.parent.name
        frames.append(f)
    if frames:
        df = pd.concat(frames, ignore_index=True)
    else:
        rows = []
        for p in sorted(d.glob("**/run=*.json")):
            m = _RUN_RE.search(p.name)
            j = load_json(p)
            flat = {k: v for k, v in j.items() if not isinstance(v, (list, dict))}
            check_numbers(j, number_keys(j), p, allow_inf_text=True)
            parent = p.parent.name
            arm = str(j.get("arm", parent))
            if "arm" not in j and parent.startswith("SERVE-"):
                arm = parent[len("SERVE-"):].rsplit("-BENCH-", 1)[0]
            flat.update(arm=arm, run=int(m.group(1)) if m else 0,
                        experiment=p.parent.parent.name)
            rows.append(flat)
        df = pd.DataFrame(rows)
    if len(df) and "request_rate" in df:
        df["request_rate"] = pd.to_numeric(df["request_rate"].replace("inf", np.inf),
                                           errors="coerce")
    if len(df) and df["experiment"].nunique() > 1:  # several experiments: keep arms apart
        df["arm"] = df["experiment"].astype(str) + "/" + df["arm"].astype(str)
    return df


def _sweep_number_key(k: object) -> bool:
    """Whether a sweep point's key (a vLLM bench result key) holds a number."""
    return str(k) in _SWEEP_NUMBER_KEYS or str(k).endswith(("_ms", "_throughput", "_goodput"))


_SWEEP_NUMBER_KEYS = {"request_rate", "max_concurrency", "max_concurrent_requests",
                      "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                      "num_gpus", "duration", "completed", "failed", "run_number", "seed",
                      "request_throughput", "output_throughput", "total_token_throughput",
                      "request_goodput",
                      *(f"{s}_{m}_ms" for s in ("mean", "median", "p50", "p90", "p95", "p99")
                        for m in ("ttft", "tpot", "itl", "e2el"))}


def number_keys(point: dict) -> list:
    """The keys of a bench result ``point`` that must hold numbers: the known ones, and the
    scalar ``*_ms`` / ``*_throughput`` / ``*_goodput`` ones (a ``*_ms`` object such as
    ``ttft_breakdown_ms`` is a breakdown, not a number)."""
    return [k for k in point if str(k) in _SWEEP_NUMBER_KEYS or (
        _sweep_number_key(k) and not isinstance(point[k], (list, dict)))]


def _numeric_column(col: pd.Series, where: Path) -> pd.Series:
    """``col`` as numbers (vLLM's ``inf`` request rate included); ServesimError naming the file,
    the column and the row of the first cell that is not a number."""
    num = pd.to_numeric(col.replace("inf", np.inf), errors="coerce")
    bad = num.isna() & col.notna()
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise ServesimError(f"{where}: column {col.name}, line {i + 2}: expected a number, got "
                            f"{short_repr(col.iloc[i])}")
    return num


def _sweep_baseline(d: Path) -> str | None:
    """The A/B baseline the sweep itself used (first ``arm_a`` of its ab.csv), if any."""
    abs_ = [d / "ab.csv"] if (d / "ab.csv").is_file() else sorted(d.glob("*/ab.csv"))
    if len(abs_) != 1:
        return None
    try:
        a = pd.read_csv(abs_[0], usecols=["arm_a"], nrows=1)
    except (ValueError, OSError):
        return None
    return str(a["arm_a"].iloc[0]) if len(a) else None


AB_METRICS = ("p99_ttft_ms", "p99_tpot_ms", "p99_e2el_ms", "output_throughput",
              "request_goodput")


def paired_ab(df: pd.DataFrame, baseline: str | None = None) -> pd.DataFrame:
    """Paired A/B deltas of each arm vs the baseline (``reports.ab.paired_ab``: same rate,
    same seed = common random numbers; Student-t 95% CI), as % of the baseline mean."""
    from servesim.reports.ab import paired_ab as _paired_ab

    if len(df) == 0 or "arm" not in df or df["arm"].nunique() < 2:
        return pd.DataFrame()
    if baseline not in set(df["arm"]):
        baseline = None
    cols = [c for c in ("arm", "request_rate", "run", *AB_METRICS) if c in df]
    rows = _paired_ab(df[cols].to_dict("records"), baseline=baseline, metrics=AB_METRICS,
                      seed_key="run")
    out = []
    for r in rows:
        if r["n"] < 1:
            continue
        v = r["verdict"]
        out.append({
            "comparison": f"{r['arm_b']} vs {r['arm_a']}", "metric": r["metric"],
            "request_rate": float(r["request_rate"]), "n_pairs": r["n"], "baseline": r["mean_a"],
            "delta": r["diff"], "delta_pct": r["rel_diff_pct"],
            "ci_low_pct": r["rel_ci_low_pct"], "ci_high_pct": r["rel_ci_high_pct"],
            "significant": v in ("B better", "B worse"),
            "verdict": {"B better": "better", "B worse": "worse"}.get(v, v)})
    return pd.DataFrame(out)


def sweep_report(d: Path) -> Report:
    from servesim.reports import figures as F

    pts = load_sweep_points(d)
    if len(pts) == 0:
        raise ServesimError(f"{d}: sweep has no run=*.json files and no readable summary.csv")
    if "request_rate" not in pts:
        pts["request_rate"] = 0.0
    slo = {}
    for k in ("ttft", "tpot", "e2el"):
        for col in (f"slo_{k}_ms", f"goodput_{k}_ms"):
            if col in pts and pts[col].notna().any():
                slo[f"{k}_ms"] = float(pts[col].dropna().iloc[0])
    ab = paired_ab(pts, baseline=_sweep_baseline(d))
    arms = list(dict.fromkeys(pts["arm"]))
    rates = sorted(pts["request_rate"].dropna().unique())
    if len(ab):
        sig = ab[ab["significant"]]
        lines = []
        for comp, g in ab.groupby("comparison", sort=False):
            s = g[g["significant"]]
            better = s[s["verdict"] == "better"]
            worse = s[s["verdict"] == "worse"]

            def _desc(x: pd.DataFrame) -> str:
                top = x.reindex(x["delta_pct"].abs().sort_values(ascending=False).index).head(2)
                return ", ".join(f"{r.metric} {r.delta_pct:+.1f}% "
                                 f"[{r.ci_low_pct:+.1f}, {r.ci_high_pct:+.1f}] at "
                                 f"{r.request_rate:g} req/s" for r in top.itertuples())

            if len(s) == 0:
                verdict = (f"**{comp}: no significant difference** in any of {len(g)} paired "
                           "(metric, rate) comparisons")
            else:
                verdict = (f"**{comp}: better on {len(better)} and worse on {len(worse)} of "
                           f"{len(g)} paired (metric, rate) comparisons**")
            if len(better):
                verdict += f"; largest gains {_desc(better)}"
            if len(worse):
                verdict += f"; largest losses {_desc(worse)}"
            lines.append(verdict + ".")
        summary = " ".join(lines) + (
            f" ({len(sig)} significant at 95% over paired seeds; {len(arms)} arms, "
            f"{len(rates)} rates.)")
    else:
        summary = (f"Sweep of {len(arms)} arm(s) over {len(rates)} request rate(s), "
                   f"{len(pts)} runs. No paired A/B comparison is possible (needs ≥ 2 arms "
                   "with the same rates and run numbers).")
        if "output_throughput" in pts:
            best = pts.groupby("arm")["output_throughput"].max().sort_values(ascending=False)
            summary += (f" Highest output throughput: {best.index[0]} "
                        f"({best.iloc[0]:,.0f} tok/s).")
    # Pareto per arm × rate (vLLM plot_pareto: user count = max_concurrency, else request rate,
    # else max_concurrent_requests; GPU count = tp·pp·dp)
    g = pts.groupby(["arm", "request_rate"], as_index=False).mean(numeric_only=True)
    g["label"] = g["arm"].astype(str) + " @" + g["request_rate"].map(lambda r: f"{r:g}")
    if "output_throughput" in g:
        users = _user_count(g)
        gpus = 1
        for c in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if c in g:
                gpus = gpus * g[c].fillna(1)
        if "num_gpus" in g:
            gpus = g["num_gpus"].fillna(1)
        g["tokens_per_s_per_user"] = g["output_throughput"] / users
        g["tokens_per_s_per_gpu"] = g["output_throughput"] / gpus
        from servesim.simulator.plan.cost import pareto_mask

        g["pareto"] = pareto_mask(g["tokens_per_s_per_user"], g["tokens_per_s_per_gpu"])
    secs = [Section("Latency vs request rate", [F.latency_vs_rate(pts, "arm", slo)]),
            Section("Throughput and goodput", [F.throughput_vs_rate(pts, "arm")])]
    if "tokens_per_s_per_gpu" in g:
        secs.append(Section("Pareto frontier", [F.pareto_front(g, "label")]))
    ab_items: list = [F.ab_deltas(ab)]
    if len(ab):
        show = ab[["comparison", "metric", "request_rate", "n_pairs", "baseline", "delta_pct",
                   "ci_low_pct", "ci_high_pct", "verdict"]]
        ab_items.append(Table(show, "Paired deltas (B − A) in % of A, 95% CI:"))
    secs.append(Section("A/B deltas", ab_items))
    cols = [c for c in ("arm", "request_rate", "run", "request_throughput", "output_throughput",
                        "p99_ttft_ms", "p99_tpot_ms", "p99_e2el_ms", "request_goodput")
            if c in pts]
    secs.append(Section("All runs", [Table(pts[cols].sort_values(cols[:3]))]))
    return Report(f"servesim sweep report: {d.name}", summary, secs)


def _user_count(g: pd.DataFrame) -> pd.Series:
    for c in ("max_concurrency", "request_rate", "max_concurrent_requests"):
        if c in g:
            v = pd.to_numeric(g[c], errors="coerce")
            v = v.where(np.isfinite(v) & (v > 0))
            if v.notna().any():
                return v
    return pd.Series(np.nan, index=g.index)
