"""``simulate calibrate import aiconfigurator``: NVIDIA's measured vLLM kernel tables → a
servesim calibration file.

The ``aiconfigurator-core`` package (Apache-2.0, NVIDIA) ships kernel timings measured by NVIDIA
on many GPUs under ``aiconfigurator_core/systems/data/<system>/<op>/vllm/<vllm-version>/``
(parquet, latencies in ms). This module reads the vLLM tables of one system and writes them
in our schema (DEVELOPERS.md "Calibration file", version 2), one measured curve per row:

===================  =============================================  ===========================
our family           their table                                    conversion
===================  =============================================  ===========================
gemm                 ``gemm/gemm_perf``                              dtype bfloat16 | fp8;
                                                                    curve over m
decode_attention     ``attention/generation_attention_perf``        context = isl + step (KV
                                                                    tokens read); window 0
prefill_attention    ``attention/context_attention_perf``           chunk = isl, context 0
allreduce            ``comm/custom_allreduce_perf``                 bytes = message_size · 2
                                                                    (bf16 elements); graph |
                                                                    eager from kernel_source
moe                  ``moe/moe_perf``                               tokens, per (hidden, inter,
                                                                    topk, experts, tp, ep)
===================  =============================================  ===========================

Where a table holds several kernels for one point (``kernel_source``: FA3 and FA4 on Hopper,
CUTLASS and torch GEMMs, ...), we keep the kernel with the most measured rows for that dtype
(aiconfigurator's own density ranking of kernel lanes); sparser kernels fill the points it
lacks. Each row records the kernels it used.

The block-scaled fp8 GEMM rows (``fp8_block``: DeepGEMM/FlashInfer) are not imported: they
are host-bound, not kernel times. Every curve has the same floor whatever its size: 56 µs on
H100 and H200, 155-260 µs on Blackwell, 287 µs on L40S. That holds even for a 512 × 7168
weight whose HBM roofline is ~1 µs. Timed on an H100 and an H200 and replayed from a CUDA
graph, as vLLM replays decode, cuBLAS's block-scaled fp8 GEMM takes 8-52 µs at 8-64 rows
for the same shapes. Over 36 points (10 shapes, 8-4,096 rows), the table's value was the
graphed time × 2.2 (H100) and × 2.6 (H200), median, up to × 10.9. The per-tensor ``fp8``
curves were × 0.98 and × 0.93 of it (``benchmarks/gpu_checks.py``, results in
``benchmarks/data/gpu_checks_*.json``). So block-scaled linears read the ``fp8`` curves
(:meth:`Calibration.gemm`).

ModelOpt-checkpoint MoE kernels are dropped (servesim's fp8 is vLLM's ``--quantization fp8``,
Fp8MoEMethod). Duplicate measurements of one point are reduced to their median; ms become seconds (4
significant digits).

By default only the curves the cost model reads for the shipped model catalog
(``configs/models``, TP 1/2/4/8, bf16 and fp8 KV/weights) are kept: the GEMM (n, k) grid
points around each linear's shape, the attention curves around each head layout (all batch
sizes for decode, batch 1 for prefill, no sliding-window variants), the MoE curves of the
catalog's MoE shapes with balanced routing (no expert parallelism; tables without balanced rows,
A100's, give their mildest skew ``power_law_1.01``), and every all-reduce row.
``--all-shapes`` keeps everything.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import re
from collections import Counter, defaultdict
from pathlib import Path

from servesim.simulator.errors import ServesimError

EXTRA_MESSAGE = ("simulate calibrate import aiconfigurator needs the optional extra: "
                 "pip install 'servesim[aiconfigurator]' (aiconfigurator-core and pyarrow)")
# their system name → our hardware catalog name
GPU_MAP = {
    "a100_sxm": "a100-sxm4-80gb",
    "h100_sxm": "h100-sxm",
    "h200_sxm": "h200-sxm",
    "b200_sxm": "b200",
    "b300_sxm": "b300",
    "gb200": "gb200",
    "gb300": "gb300",
    "l40s": "l40s",
    "rtx_pro_6000_server": "rtx-pro-6000",
}
TABLES = {  # our family → (their op folder, parquet file)
    "gemm": ("gemm", "gemm_perf.parquet"),
    "decode_attention": ("attention", "generation_attention_perf.parquet"),
    "prefill_attention": ("attention", "context_attention_perf.parquet"),
    "allreduce": ("comm", "custom_allreduce_perf.parquet"),
    "moe": ("moe", "moe_perf.parquet"),
}
GEMM_KEEP = ("bfloat16", "fp8")  # not fp8_block: host-bound rows (module docstring)
MOE_DISTRIBUTIONS = ("balanced", "power_law_1.01")  # preference order (A100 has no balanced)
TPS = (1, 2, 4, 8)
ATTRIBUTION = ("Kernel timings measured by NVIDIA: aiconfigurator-core "
               "(https://github.com/ai-dynamo/aiconfigurator), Copyright (c) 2025-2026 NVIDIA "
               "CORPORATION & AFFILIATES, licensed under the Apache License 2.0. Modified by "
               "servesim: ms converted to seconds (4 significant digits), duplicate points "
               "reduced to their median, one kernel per point, a subset of shapes (see 'kept'), "
               "no block-fp8 GEMM rows (host-bound).")


def _version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.\-]", v))


def system_name(gpu: str) -> tuple[str, str]:
    """(their system, our hardware name) for either spelling."""
    for theirs, ours in GPU_MAP.items():
        if gpu in (theirs, ours):
            return theirs, ours
    names = ", ".join(f"{o} ({t})" for t, o in GPU_MAP.items())
    raise ServesimError(f"--gpu {gpu}: not a GPU with vLLM tables in aiconfigurator-core; "
                        f"expected one of {names}")


def find_data_dir(data_dir: Path | None = None) -> tuple[Path, str]:
    """(``systems/data`` folder, aiconfigurator-core version). ``data_dir`` overrides the
    installed package (its version is then read from a neighbouring ``.dist-info``)."""
    if data_dir is not None:
        d = Path(data_dir).expanduser()
        if not d.is_dir():
            raise ServesimError(f"--data-dir {d}: no such folder (expected aiconfigurator_core/"
                                "systems/data)")
        version = "unknown"
        for parent in list(d.resolve().parents)[:4]:
            hits = sorted(parent.glob("aiconfigurator_core-*.dist-info"))
            if hits:
                version = hits[-1].name.split("-")[1].replace(".dist", "")
                break
        return d, version
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        raise ServesimError(EXTRA_MESSAGE)
    root = Path(next(iter(spec.submodule_search_locations)))
    from importlib import metadata

    try:
        version = metadata.version("aiconfigurator-core")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return root / "systems" / "data", version


def table_versions(data_dir: Path, system: str, family: str) -> list[str]:
    """vLLM versions that have this family's parquet for ``system``, oldest first."""
    op, fname = TABLES[family]
    base = data_dir / system / op / "vllm"
    if not base.is_dir():
        return []
    return sorted((p.name for p in base.iterdir() if (p / fname).is_file()), key=_version_key)


def read_parquet(path: Path):
    """A parquet file as a pandas DataFrame; the extra's one-line error without an engine."""
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except ImportError:
        raise ServesimError(EXTRA_MESSAGE) from None
    except (OSError, ValueError) as e:
        raise ServesimError(f"{path}: cannot read parquet ({str(e).splitlines()[0]})") from None


def _need(df, cols: tuple[str, ...], path: Path) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ServesimError(f"{path}: expected columns {', '.join(missing)}")


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _curves(df, cats: list[str], keys: list[str], x: str) -> list[dict]:
    """Rows of ``df`` (cols: cats, keys, x, kernel, seconds) → one curve per (cats, keys).

    Each point comes from the densest kernel lane (most rows for those cats) that measured it;
    sparser lanes fill the points it lacks (aiconfigurator's lane walk: e.g. FA3 with FA4
    filling in on Hopper). Duplicates: their median."""
    density = Counter(zip(*(df[c] for c in cats), df["kernel"]))
    groups: dict[tuple, dict[float, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    cols = [df[c] for c in cats + keys] + [df["kernel"], df[x], df["seconds"]]
    for row in zip(*cols):
        *ck, kern, xv, t = row
        groups[tuple(ck)][xv][kern].append(t)
    out = []
    for ck, by_x in groups.items():
        cat = ck[:len(cats)]
        xs = sorted(by_x)
        used = []
        secs = []
        for v in xs:
            kern = max(by_x[v], key=lambda k: (density[(*cat, k)], k))
            secs.append(_sig(_median(by_x[v][kern])))
            if kern not in used:
                used.append(kern)
        row = {c: _py(v) for c, v in zip(cats + keys, ck)}
        row["kernel"] = "+".join(str(k) for k in used)
        row[x] = [_py(v) for v in xs]
        row["seconds"] = secs
        out.append(row)
    out.sort(key=lambda r: tuple(str(r[c]) for c in cats) + tuple(r[k] for k in keys))
    return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _py(v):
    """numpy scalar → int/float/str."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def convert(family: str, df, path: Path) -> list[dict]:
    """One aiconfigurator table → our rows (one curve each), all shapes."""
    df = df.copy()
    df["seconds"] = df["latency"].astype(float) * 1e-3
    df["kernel"] = df["kernel_source"].astype(str) if "kernel_source" in df else "unknown"
    if family == "gemm":
        _need(df, ("m", "n", "k", "gemm_dtype", "latency"), path)
        df = df[df["gemm_dtype"].isin(GEMM_KEEP)].rename(columns={"gemm_dtype": "dtype"})
        return _curves(df, ["dtype"], ["n", "k"], "m")
    if family in ("decode_attention", "prefill_attention"):
        _need(df, ("batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim",
                   "kv_cache_dtype", "latency"), path)
        if "window_size" in df:
            df = df[df["window_size"] == 0]
        if "step" not in df:
            df["step"] = 0
        df = df.rename(columns={"batch_size": "batch", "num_key_value_heads": "num_kv_heads",
                                "kv_cache_dtype": "kv_dtype"})
        df["kv_dtype"] = df["kv_dtype"].map(lambda v: "fp8" if "fp8" in str(v) else str(v))
        keys = ["head_dim", "num_kv_heads", "num_heads", "batch"]
        if family == "decode_attention":
            df["context"] = df["isl"] + df["step"]
            return _curves(df, ["kv_dtype"], keys, "context")
        df = df[df["step"] == 0].copy()
        df["context"] = 0
        df["chunk"] = df["isl"]
        return _curves(df, ["kv_dtype"], keys + ["context"], "chunk")
    if family == "allreduce":
        _need(df, ("num_gpus", "message_size", "latency"), path)
        df["mode"] = df["kernel"].map(lambda k: "graph" if "graph" in k.lower() else "eager")
        df["dtype"] = df["allreduce_dtype"].astype(str) if "allreduce_dtype" in df \
            else "bfloat16"
        elem = df["dtype"].map(lambda d: 1 if "8" in d else 4 if "32" in d else 2)
        df["bytes"] = df["message_size"].astype("int64") * elem
        df = df.rename(columns={"num_gpus": "tp"})
        return _curves(df, ["mode", "dtype"], ["tp"], "bytes")
    _need(df, ("num_tokens", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size",
               "moe_ep_size", "moe_dtype", "latency"), path)
    df = df.rename(columns={"num_tokens": "tokens", "hidden_size": "hidden",
                            "inter_size": "inter", "num_experts": "experts",
                            "moe_tp_size": "tp", "moe_ep_size": "ep", "moe_dtype": "dtype"})
    if "distribution" not in df:
        df["distribution"] = "balanced"
    # ModelOpt-checkpoint MoE paths are not what `--quantization fp8` (Fp8MoEMethod) runs
    df = df[~df["kernel"].str.contains("modelopt")]
    return _curves(df, ["dtype", "distribution"], ["hidden", "inter", "topk", "experts", "tp",
                                                    "ep"], "tokens")


# ---------------------------------------------------------------------------------------------
# which curves the cost model reads for the shipped catalog


def catalog_needs() -> dict[str, set]:
    """Lookup keys the cost model uses for the model catalog at TP 1/2/4/8:
    ``gemm``: {(dtype, n, k)}; ``attention``: {(kv_dtype, head_dim, kv_heads, heads)};
    ``moe``: {(dtype, hidden, inter, topk, experts, tp)}."""
    from servesim.costmodels.config import ModelConfig
    from servesim.costmodels.engine_defaults import validate_parallel
    from servesim.costmodels.specs import Linear, load_model_spec, model_names

    gemm, attn, moe = set(), set(), set()
    for name in model_names():
        spec = load_model_spec(ModelConfig(name=name))
        dtypes = ["bfloat16", "fp8_block" if spec.weight_block_size else "fp8"]
        if spec.quant_method:  # shipped quantized: its own format only
            dtypes = dtypes[1:]
        gemm_dtypes = [d.replace("fp8_block", "fp8") for d in dtypes]  # what gemm() reads
        for tp in TPS:
            try:
                validate_parallel(spec, tp, 1)
            except ServesimError:
                continue
            v_r = -(-spec.vocab_size // tp)
            lins = [(lin, *lin.shard(tp)) for lin in spec.linears()]
            lins.append((Linear("lm_head", "lm_head", spec.hidden_size, v_r, 1, "replicated",
                                quantized=False), v_r, spec.hidden_size))
            for lin, n, k in lins:
                for dt in (gemm_dtypes if lin.quantized else ["bfloat16"]):
                    gemm.add((dt, n, k))
            if not spec.is_mla:
                for kv in ("bfloat16", "fp8"):
                    attn.add((kv, spec.head_dim, spec.kv_heads_per_rank(tp),
                              spec.num_attention_heads // tp))
            if spec.is_moe:
                for dt in dtypes:
                    moe.add((dt, spec.hidden_size, spec.moe_intermediate_size,
                             spec.num_experts_per_tok, spec.num_experts, tp))
    return {"gemm": gemm, "attention": attn, "moe": moe}


def subset(doc: dict, spec) -> dict[str, str]:
    """Keep only the curves the catalog's lookups read (in place); returns what was kept."""
    from servesim.costmodels.calibration import FAMILIES, Calibration

    cal = Calibration(Path("import"), doc, spec)
    needs = catalog_needs()
    keep: dict[str, set[tuple]] = defaultdict(set)  # family → {(cat..., key...)}
    for dt, n, k in needs["gemm"]:
        t = cal.tables.get("gemm", {}).get((dt,))
        if t is not None:
            keep["gemm"] |= {(dt, *key) for key in t.support((n, k))}
    for kv, hd, kvh, nh in needs["attention"]:
        t = cal.tables.get("decode_attention", {}).get((kv,))
        if t is not None:
            for b in t.axes[3]:
                keep["decode_attention"] |= {(kv, *key) for key in t.support((hd, kvh, nh, b))}
        t = cal.tables.get("prefill_attention", {}).get((kv,))
        if t is not None:
            keep["prefill_attention"] |= {(kv, *key) for key in
                                          t.support((hd, kvh, nh, 1, 0))}
    for want, h, i, k, e, tp in needs["moe"]:
        alts = {"fp8": ("fp8", "fp8_block"), "fp8_block": ("fp8_block", "fp8")}.get(
            want, (want,))  # the order Calibration.moe reads them in
        found = False
        for dt in alts:
            for dist in MOE_DISTRIBUTIONS:  # balanced routing; else the mildest skew measured
                t = cal.tables.get("moe", {}).get((dt, dist))
                if t is not None and not found:
                    keep["moe"] |= {(dt, dist, *key) for key in t.support((h, i, k, e, tp, 1))}
                    found = True
    notes = {}
    for fam in ("gemm", "decode_attention", "prefill_attention", "moe"):
        f = FAMILIES[fam]
        rows = doc.get(fam) or []
        kept = [r for r in rows if (*(r[c] for c in f.cats), *(r[k] for k in f.keys))
                in keep[fam]]
        notes[fam] = f"{len(kept)} of {len(rows)} curves"
        doc[fam] = kept
    notes["allreduce"] = f"all {len(doc.get('allreduce') or [])} curves"
    return notes


# ---------------------------------------------------------------------------------------------
# the import


def import_tables(gpu: str, *, vllm_version: str | None = None, data_dir: Path | None = None,
                  all_shapes: bool = False, log=print) -> dict:
    """The calibration document for ``gpu`` (our or their name) from aiconfigurator-core."""
    from servesim.costmodels.config import HardwareConfig
    from servesim.costmodels.specs import load_hardware_spec

    theirs, ours = system_name(gpu)
    root, pkg_version = find_data_dir(data_dir)
    if importlib.util.find_spec("pyarrow") is None and importlib.util.find_spec(
            "fastparquet") is None:
        raise ServesimError(EXTRA_MESSAGE)
    spec = load_hardware_spec(HardwareConfig(name=ours))
    doc: dict = {"version": 2, "gpu": ours}
    tables: dict[str, dict] = {}
    device = None
    for fam, (op, fname) in TABLES.items():
        versions = table_versions(root, theirs, fam)
        if not versions:
            log(f"note: no vLLM {fam} table for {theirs}")
            continue
        v = vllm_version if vllm_version in versions else versions[-1]
        if vllm_version and v != vllm_version:
            log(f"note: {fam}: no vLLM {vllm_version} table for {theirs}; using {v} "
                f"(available: {', '.join(versions)})")
        path = root / theirs / op / "vllm" / v / fname
        df = read_parquet(path)
        if device is None and "device" in df and len(df):
            device = str(df["device"].iloc[0])
        rows = convert(fam, df, path)
        doc[fam] = rows
        tables[fam] = {"source": f"aiconfigurator-{pkg_version}/vllm-{v}", "vllm": v,
                       "table": f"{theirs}/{op}/vllm/{v}/{fname}", "rows_read": len(df)}
    if not tables:
        raise ServesimError(f"{root / theirs}: no vLLM tables found")
    kept = {f: "all curves" for f in tables} if all_shapes else subset(doc, spec)
    for fam, t in tables.items():
        t["kept"] = kept.get(fam, "")
        t["points"] = sum(len(r["seconds"]) for r in doc.get(fam) or [])
        t["kernels"] = sorted({k for r in doc.get(fam) or [] for k in r["kernel"].split("+")})
    from importlib import metadata

    try:
        ver = metadata.version("servesim")
    except metadata.PackageNotFoundError:
        ver = "0+unknown"
    cmd = f"simulate calibrate import aiconfigurator --gpu {ours}"
    if vllm_version:
        cmd += f" --vllm-version {vllm_version}"
    if all_shapes:
        cmd += " --all-shapes"
    return {
        "version": 2,
        "gpu": ours,
        "source": {
            "kind": "aiconfigurator", "package": "aiconfigurator-core",
            "package_version": pkg_version, "license": "Apache-2.0",
            "attribution": ATTRIBUTION, "system": theirs, "device": device,
            "shapes": "all" if all_shapes else "catalog (configs/models at TP 1/2/4/8)",
            "command": cmd,
        },
        "fingerprint": {"device_name": device, "mode": "imported", "servesim_version": ver,
                        "imported": _dt.date.today().isoformat()},
        "peaks": {"bf16_tflops": spec.bf16_tflops, "fp8_tflops": spec.fp8_tflops,
                  "mem_bw_gbps": spec.mem_bw_gbps, "link_bw_gbps": spec.link_bw_gbps},
        "tables": tables,
        **{fam: doc.get(fam, []) for fam in TABLES},
    }
