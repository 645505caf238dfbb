"""A point: one simulation, defined by its config tree, seed and offered rate → a result record.

Both experiment kinds are made of points: a sweep's arm × rate × seed grid, a plan's
(candidate, rate, seed) probes. A point is stored at ``SERVE-<arm>-BENCH-<rate>/run=<seed>.json``
(``vllm bench sweep``'s layout; the plan's "arm" is its candidate) and identified for
``--resume`` by a content hash of everything that defines it: its raw tree and
:func:`inputs_hash` (code, resolved defaults, specs and file contents).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servesim.simulator.errors import ServesimError


@dataclass(frozen=True)
class Point:
    """Where one simulation's record lives: arm (or plan candidate), rate label and seed."""

    arm: str
    rate: float | None  # req/s; None: the base config's own rate (e.g. a trace replay)
    rate_label: str
    seed: int

    @property
    def dirname(self) -> str:
        return f"SERVE-{self.arm}-BENCH-{self.rate_label}"

    @property
    def run_name(self) -> str:
        return f"run={self.seed}.json"

    @property
    def failure_name(self) -> str:
        return f"run={self.seed}.failure.json"


def content_hash(*parts: Any) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of ``parts`` (keys sorted)."""
    blob = json.dumps(list(parts), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fmt_rate(rate: float | None) -> str:
    """Folder label of a request rate: ``4``, ``2.5``, ``inf``, ``1e+300`` (``base`` for
    None)."""
    if rate is None:
        return "base"
    if math.isinf(rate):
        return "inf"
    return str(int(rate)) if float(rate).is_integer() and rate < 1e15 else repr(float(rate))


def one_line(e: BaseException) -> str:
    """A failed point's error as one line: the message of a ServesimError, else ``Type: msg``."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, ServesimError):
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def inputs_hash(tree: dict) -> str:
    """16 hex digits identifying what a point's result depends on beyond its raw tree: the
    servesim code and shipped files (:func:`code_hash`), the config as resolved (defaults
    filled in: a default that changed between versions changes it), the model, draft-model
    and GPU specs read (a drop-in config.json included; not where the files are) and the bytes
    of every calibration and trace file it reads. A tree that does not resolve hashes its
    error (the point then fails, in its worker)."""
    from servesim.costmodels.calibration import calibration_paths
    from servesim.costmodels.config import ModelConfig
    from servesim.costmodels.specs import load_hardware_spec, load_model_spec
    from servesim.simulator.config import resolve_config, validate_tree

    try:
        cfg = resolve_config(validate_tree(copy.deepcopy(tree), "point"))
        parts: list = [code_hash(), cfg.dump_tree(mode="json")]
        for g in [cfg] + list(cfg.cluster.instances if cfg.cluster else []):
            model, hw = getattr(g, "model", None), getattr(g, "hardware", None)
            if model is not None:
                parts.append(_spec_dict(load_model_spec(model)))
            if hw is not None:
                spec = load_hardware_spec(hw)
                parts += [_spec_dict(spec),
                          [file_hash(p) for p in calibration_paths(hw, spec)]]
        draft = getattr(cfg.speculative_config, "model", None)
        if draft:
            parts.append(_spec_dict(load_model_spec(ModelConfig(name=draft))))
        parts.append([file_hash(Path(p)) for p in _trace_paths(parts[1].get("workload"))])
    except Exception as e:  # noqa: BLE001 (any failure is the point's: its worker reports it)
        parts = [code_hash(), "invalid", one_line(e)]
    return content_hash(*parts)


def _spec_dict(spec: Any) -> dict:
    """A spec dataclass as a dict without where it was read from (``source``, ``file``), so
    one install hashes alike wherever it lives."""
    from dataclasses import asdict

    d = asdict(spec)
    for k in ("source", "file"):
        d.pop(k, None)
    return d


def check_input_files(cfg: Any, where: str) -> None:
    """The workload files (traces, profiles, length files) a validated config reads exist: a
    one-line error naming ``where`` and the file, before any point runs. Relative paths are
    read from the working directory, as ``simulate run`` reads them."""
    from servesim.simulator.errors import ConfigError, path_is_file

    for p in _trace_paths(cfg.dump_tree(mode="json").get("workload")):
        if not path_is_file(Path(p)):
            raise ConfigError(f"{where}: workload: {p}: no such file (relative paths are read "
                              "from the working directory)")


def _trace_paths(node: Any) -> list[str]:
    """Every ``path`` value under a workload dump (trace, session and profile files)."""
    if isinstance(node, dict):
        out = [node["path"]] if isinstance(node.get("path"), str) else []
        return out + [p for k, v in node.items() if k != "path" for p in _trace_paths(v)]
    if isinstance(node, list):
        return [p for v in node for p in _trace_paths(v)]
    return []


_file_hashes: dict[tuple, str] = {}


def file_hash(path: Path) -> str:
    """SHA-256 (16 hex digits) of a file's bytes, cached per path, size and mtime; "missing"
    when it is not a readable file."""
    try:
        st = path.stat()
    except (OSError, ValueError):  # (ValueError: a NUL byte in the name)
        return f"missing:{path}"
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _file_hashes:
        h = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError:
            return f"missing:{path}"
        _file_hashes[key] = h.hexdigest()[:16]
    return _file_hashes[key]


@functools.cache
def code_hash() -> str:
    """SHA-256 (16 hex digits) of the installed servesim package's source and shipped data
    files (``*.py``, ``*.yaml``, ``*.json``): results from other code are not reused."""
    from importlib.util import find_spec

    h = hashlib.sha256()
    for name in CODE_PACKAGES:
        root = Path(next(iter(find_spec(f"servesim.{name}").submodule_search_locations)))
        for p in sorted(q for ext in ("*.py", "*.yaml", "*.json") for q in root.rglob(ext)
                        if not any(part.startswith((".", "__pycache__"))
                                   for part in q.relative_to(root).parts)):
            h.update(f"{name}/{p.relative_to(root).as_posix()}\0{file_hash(p)}".encode())
    return h.hexdigest()[:16]


# The servesim.<folder> packages (pyproject's package-dir), without importing them.
CODE_PACKAGES = ("simulator", "costmodels", "kernels", "workloads", "reports", "configs")
