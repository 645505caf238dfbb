"""Calibration files for the cost model: which files a config selects, reading and caching
them, and one-line warnings when a file is missing, stale or for another GPU.

``hardware.calibration: auto`` layers the user's own measured file
(``$SERVESIM_CALIBRATION_DIR/<gpu>.yaml``, default ``~/.config/servesim/calibration``) over
the shipped ``configs/calibration/<gpu>.yaml`` (or ``.json``): per family, the first file that
has rows wins. ``none`` uses the default efficiencies; a path reads that file.

This module is the calibration API of the cost model; the work is done by
``calibration_tables`` (:class:`Calibration`: rows → per-family tables, lookups, provenance),
``calibration_curves`` (interpolation, roofline fallback, the fit check) and
``calibration_roofline`` (roofline seconds per family). Schema: DEVELOPERS.md
"Calibration file".
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from servesim.costmodels.calibration_curves import Series, Table, check
from servesim.costmodels.calibration_roofline import gemm_roof, norm_dtype
from servesim.costmodels.calibration_tables import FAMILIES, Calibration, age_days
from servesim.costmodels.config import HardwareConfig
from servesim.costmodels.specs import HardwareSpec, _read_mapping, configs_dir
from servesim.simulator.errors import ConfigError, path_is_file

STALE_DAYS = 180


class CalibrationWarning(UserWarning):
    """A calibration file is missing for the GPU, stale, or for another GPU."""


_warned: set[str] = set()


def _warn(msg: str) -> None:
    """One-line warning, once per process per message."""
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, CalibrationWarning, stacklevel=3)


def user_calibration_dir() -> Path:
    """Where ``simulate calibrate`` writes a GPU's own measurements and ``auto`` looks first:
    ``$SERVESIM_CALIBRATION_DIR``, else ``$XDG_CONFIG_HOME/servesim/calibration`` (default
    ``~/.config/servesim/calibration``)."""
    env = os.environ.get("SERVESIM_CALIBRATION_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "servesim" / "calibration"


def calibration_paths(hw_cfg: HardwareConfig, spec: HardwareSpec) -> list[Path]:
    """Files ``hardware.calibration`` selects, highest precedence first ([]: defaults).
    ``auto``: the user's measured file, then the shipped one (those that exist). A file with
    ``layer_over: auto`` (what ``simulate fit`` writes) is followed by what ``auto`` selects,
    so it need only hold what it changes."""
    sel = (hw_cfg.calibration or "auto").strip()
    if sel.lower() == "none":
        return []
    if sel.lower() == "auto":
        return _auto_paths(spec)
    p = Path(sel).expanduser()
    paths = [p]
    if path_is_file(p):
        try:
            layer = str(read_doc(p).get("layer_over", "")).strip().lower()
        except (ConfigError, OSError):
            return paths  # load_calibration reports the file
        if layer == "auto":
            paths += [q for q in _auto_paths(spec) if q.resolve() != p.resolve()]
    return paths


def _auto_paths(spec: HardwareSpec) -> list[Path]:
    found = []
    for d in (user_calibration_dir(), configs_dir() / "calibration"):
        p = next((d / f"{spec.name}{ext}" for ext in (".yaml", ".json")
                  if path_is_file(d / f"{spec.name}{ext}")), None)
        if p is not None:
            found.append(p)
    return found


_doc_cache: dict[tuple, dict] = {}
_cal_cache: dict[tuple, Calibration] = {}


def read_doc(path: Path, cached: bool = True) -> dict:
    """Parsed calibration file, YAML or (``.json``, ~40x faster to load) JSON; ConfigError on
    bad input. ``cached``: shared (do not mutate) per path, size and mtime."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    doc = _doc_cache.get(key) if cached else None
    if doc is None:
        doc = _read_mapping(path, "calibration")
        if cached:
            _doc_cache[key] = doc
    return doc


def open_calibration(paths: list[Path], spec: HardwareSpec | None) -> Calibration:
    """:class:`Calibration` over ``paths`` (cached per file versions and GPU spec)."""
    stamps = tuple((str(p.resolve()), p.stat().st_mtime_ns, p.stat().st_size) for p in paths)
    key = (stamps, spec)
    cal = _cal_cache.get(key)
    if cal is None:
        cal = Calibration(list(paths), [read_doc(p) for p in paths], spec)
        _cal_cache[key] = cal
    return cal


def load_calibration(hw_cfg: HardwareConfig, spec: HardwareSpec) -> Calibration | None:
    """Load the calibration the ``hardware`` section selects, warning (one line) when no file
    exists for this GPU, a measured file is partial, stale (> 180 days) or made for another
    GPU."""
    sel = (hw_cfg.calibration or "auto").strip().lower()
    if sel == "none":
        return None
    paths = calibration_paths(hw_cfg, spec)
    if sel != "auto" and not path_is_file(paths[0]):
        raise ConfigError(f"hardware.calibration: no such calibration file {paths[0]}")
    if not paths:
        _warn(f"no calibration file configs/calibration/{spec.name}.yaml (or .json) for "
              f"{spec.name}: "
              "using default efficiencies (provenance 'roofline:default'); run `simulate "
              "calibrate` on that GPU")
        return None
    cal = open_calibration(paths, spec)
    for p in paths:
        doc = read_doc(p)
        gpu = str(doc.get("gpu", ""))
        if gpu and gpu != spec.name:
            _warn(f"{p}: calibrated on '{gpu}' but hardware is '{spec.name}'")
        partial = (doc.get("source") or {}).get("partial")
        if partial:
            _warn(f"{p}: a partial calibration ({partial}); each op family it has replaces "
                  "the shipped one (but attention or MoE measured only on stand-ins for "
                  "vLLM's kernels): re-run `simulate calibrate` to complete it")
        if (doc.get("source") or {}).get("kind") == "aiconfigurator":
            continue  # imported tables carry their package and vLLM versions, not a date
        age = age_days(doc.get("fingerprint"))
        if age is not None and age > STALE_DAYS:
            _warn(f"{p}: calibration fingerprint is {age:.0f} days old (> {STALE_DAYS}); "
                  "re-run `simulate calibrate`")
    fitted_on = cal.scales_tables or {}
    moved = [f for f in cal.yielded if cal.scales and fitted_on.get(f) != cal.sources[f]]
    if moved:  # (a fit made before stand-ins yielded to vLLM's kernels)
        _warn(f"{cal.scales_path}: its scales were fitted on other kernel tables than these: "
              + "; ".join(f"{f} now from {cal.sources[f]} (vLLM's kernels), not "
                          f"{cal.yielded[f]} (stand-ins)" for f in moved)
              + ": re-run `simulate fit`")
    return cal


__all__ = [
    "FAMILIES",
    "Calibration",
    "CalibrationWarning",
    "Series",
    "Table",
    "calibration_paths",
    "check",
    "gemm_roof",
    "load_calibration",
    "norm_dtype",
    "open_calibration",
    "read_doc",
    "user_calibration_dir",
]
