"""What a calibration file says, for people: ``simulate calibrate report`` (kernel quality:
Triton vs the vendor path, achieved bandwidth and FLOP/s as % of the spec peaks) and
``simulate calibrate check`` (how well the cost model's lookups reproduce the file's rows).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from servesim.kernels.calibration_file import read_calibration
from servesim.simulator.errors import ServesimError


def _stats(xs: list[float]) -> dict:
    """n, median, geomean, min, max of ``xs`` (None where empty)."""
    if not xs:
        return {"n": 0, "median": None, "geomean": None, "min": None, "max": None}
    xs = sorted(xs)
    return {"n": len(xs), "median": statistics.median(xs),
            "geomean": math.exp(sum(math.log(x) for x in xs) / len(xs)),
            "min": xs[0], "max": xs[-1]}


def _stats_text(st: dict) -> str:
    if not st["n"]:
        return "no rows"
    return (f"n={st['n']:<4} median {st['median']:6.2f}  geomean {st['geomean']:6.2f}  "
            f"min {st['min']:6.2f}  max {st['max']:6.2f}")


def report_data(doc: dict) -> dict:
    """Kernel quality: Triton/vendor GEMM time by M class (ratio), decode attention's achieved
    bandwidth (% of the spec's GB/s) and prefill attention's achieved FLOP/s (% of the spec's
    bf16 TFLOP/s), each as n/median/geomean/min/max over the file's rows."""
    if (doc.get("source") or {}).get("kind") == "aiconfigurator":
        raise ServesimError("calibrate report: kernel quality compares servesim's Triton kernels "
                            "with the vendor path, which only `simulate calibrate` measures; "
                            "this file is imported: use `simulate calibrate check FILE`")
    peaks = doc["peaks"]
    bw = peaks["mem_bw_gbps"] * 1e9
    out: dict = {"gpu": doc["gpu"], "fingerprint": doc.get("fingerprint") or {},
                 "synthetic": bool(doc.get("synthetic")), "peaks": peaks,
                 "memcpy_best_gbps": None, "gemm": [], "decode_attention": [],
                 "prefill_attention": []}
    if doc["memcpy"]:  # read + write bytes per second
        out["memcpy_best_gbps"] = max(2 * r["bytes"] / r["seconds"] for r in doc["memcpy"]) / 1e9
    for dtype in sorted({r["dtype"] for r in doc["gemm"]}):
        rows = [r for r in doc["gemm"] if r["dtype"] == dtype and r["triton_s"] and r["vendor_s"]]
        for label, pred in (("M <= 16", lambda m: m <= 16),
                            ("16 < M < 256", lambda m: 16 < m < 256),
                            ("M >= 256", lambda m: m >= 256)):
            xs = [r["triton_s"] / r["vendor_s"] for r in rows if pred(r["m"])]
            out["gemm"].append({"dtype": dtype, "rows": label,
                                "triton_over_vendor": _stats(xs)})
    for impl in ("triton_s", "vendor_s"):
        rows = [r for r in doc["decode_attention"] if r.get(impl)]
        for label, pred in (("batch>=16 ctx>=4k", lambda r: r["batch"] >= 16 and
                             r["context_max"] >= 4096),
                            ("other", lambda r: not (r["batch"] >= 16 and
                                                     r["context_max"] >= 4096))):
            xs = [100 * r["bytes"] / r[impl] / bw for r in rows if pred(r)]
            out["decode_attention"].append({"impl": impl[:-2], "rows": label,
                                            "pct_of_bandwidth": _stats(xs)})
    for impl in ("triton_s", "vendor_s"):
        rows = [r for r in doc["prefill_attention"] if r.get(impl)]
        for label, pred in (("chunk < 512", lambda r: r["chunk"] < 512),
                            ("chunk >= 512", lambda r: r["chunk"] >= 512)):
            xs = [100 * r["flops"] / r[impl] / (peaks["bf16_tflops"] * 1e12)
                  for r in rows if pred(r)]
            out["prefill_attention"].append({"impl": impl[:-2], "rows": label,
                                             "pct_of_bf16_flops": _stats(xs)})
    return out


def report_lines(doc: dict) -> list[str]:
    """:func:`report_data` as text."""
    d = report_data(doc)
    fp, peaks = d["fingerprint"], d["peaks"]
    out = [(f"calibration for {d['gpu']}: {fp.get('device_name')} "
            f"({fp.get('sm_count')} SMs), {fp.get('mode')} run {fp.get('date')}; "
            f"torch {fp.get('torch')}, triton {fp.get('triton')}, CUDA {fp.get('cuda')}, "
            f"driver {fp.get('driver')}")]
    if d["synthetic"]:
        out.append("WARNING: synthetic numbers (test fixture), not measurements")
    best = d["memcpy_best_gbps"]
    if best is not None:
        out.append(f"memcpy: best device-to-device {best:,.0f} GB/s (read + write) = "
                   f"{100 * best / peaks['mem_bw_gbps']:.0f}% of {peaks['mem_bw_gbps']} GB/s")
    out.append("GEMM Triton time / vendor time (< 1 = Triton faster; target <= 1.25 at M >= 256)")
    for g in d["gemm"]:
        out.append(f"  {g['dtype']:<14}{g['rows']:<14}{_stats_text(g['triton_over_vendor'])}")
    out.append(f"decode attention achieved bandwidth, % of {peaks['mem_bw_gbps']} GB/s "
               "(target >= 70 at batch >= 16, context >= 4k)")
    for a in d["decode_attention"]:
        out.append(f"  {a['impl']:<8}{a['rows']:<20}{_stats_text(a['pct_of_bandwidth'])}")
    out.append("prefill attention achieved TFLOP/s, % of spec "
               f"(bf16 {peaks['bf16_tflops']} TFLOP/s)")
    for a in d["prefill_attention"]:
        out.append(f"  {a['impl']:<8}{a['rows']:<20}{_stats_text(a['pct_of_bf16_flops'])}")
    return out


def check_file(path: Path) -> dict:
    """``costmodels.calibration.check`` of a calibration file (validated first), as
    ``{file, gpu, source, families: {family: {...}}}``."""
    from servesim.costmodels.calibration import Calibration, check
    from servesim.costmodels.config import HardwareConfig
    from servesim.costmodels.specs import hardware_names, load_hardware_spec

    doc = read_calibration(path)
    gpu = str(doc.get("gpu", ""))
    spec = load_hardware_spec(HardwareConfig(name=gpu)) if gpu in hardware_names() else None
    cal = Calibration(Path(path), doc, spec)
    return {"file": str(path), "gpu": gpu, "source": doc.get("source") or {},
            "synthetic": bool(doc.get("synthetic")), "families": check(cal)}


def check_lines(path: Path, res: dict) -> list[str]:
    """The check as a table: per family, curves, points, median/P90 |error| at the measured
    points and leave-one-out (each point predicted from its curve's other points)."""
    src = res["source"]
    if src.get("kind") == "aiconfigurator":
        what = (f"{src.get('package')} {src.get('package_version')}, {src.get('device')}, "
                "measured by NVIDIA (Apache-2.0)")
    else:
        what = "SYNTHETIC test fixture, not a measurement" if res.get("synthetic") else \
            "measured with simulate calibrate"
    head = (f"{'family':<19}{'source':<36}{'curves':>7}{'points':>8}   "
            f"{'|err| at rows med/P90':<23}{'leave-one-out med/P90':<22}")
    out = [f"calibration check: {path} (gpu {res['gpu']}; {what})", head]

    def pct(x):
        return "  n/a" if math.isnan(x) else f"{100 * x:5.2f}%"

    for fam, r in res["families"].items():
        out.append(f"{fam:<19}{str(r['source'])[:35]:<36}{r['curves']:>7}{r['points']:>8}   "
                   f"{pct(r['median_abs_err'])} / {pct(r['p90_abs_err']):<12}"
                   f"{pct(r['loo_median_abs_err'])} / {pct(r['loo_p90_abs_err'])}")
    out.append("at rows: the cost model's lookup at each measured point (interpolation is exact "
               "there); leave-one-out: each point predicted from its neighbours along the curve "
               "(ends: roofline x the neighbour's efficiency), i.e. the error between points")
    return out
