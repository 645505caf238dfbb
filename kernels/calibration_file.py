"""Calibration files on disk: schema check, reading, and writing (YAML or JSON, atomically).

Schema: DEVELOPERS.md "Calibration file". Version 2 (what ``simulate calibrate`` and the
aiconfigurator import write) is validated by loading it with the cost model's reader, so what
validates here loads there; version-1 files (point rows with ``triton_s``/``vendor_s``) are
checked key by key. Rows written here carry a few extra keys (``ops``, ``vendor_impl``,
``kv_dtype``, ``traffic_bytes``), never fewer. Times are in seconds.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml
from servesim.simulator.errors import ServesimError

ROW_KEYS = {
    "memcpy": ("bytes", "seconds"),
    "gemm": ("m", "n", "k", "dtype", "flops", "bytes", "triton_s", "vendor_s"),
    "decode_attention": ("batch", "context", "context_max", "num_heads", "num_kv_heads",
                         "head_dim", "block_size", "dtype", "flops", "bytes", "triton_s",
                         "vendor_s"),
    "prefill_attention": ("batch", "chunk", "context", "num_heads", "num_kv_heads", "head_dim",
                          "dtype", "flops", "bytes", "triton_s", "vendor_s"),
}
FINGERPRINT_KEYS = ("device_name", "sm_count", "driver", "cuda", "torch", "triton", "date",
                    "servesim_version", "mode")


def validate_calibration(doc, where: str) -> dict:
    """Check a calibration document against the DEVELOPERS.md schema; one-line errors."""
    if not isinstance(doc, dict):
        raise ServesimError(f"{where}: expected a mapping at the top level")
    if doc.get("version") == 2:
        return _validate_v2(doc, where)
    if doc.get("version") != 1:
        raise ServesimError(f"{where}: version: expected 1 or 2, got {doc.get('version')!r}")
    for key in ("gpu", "fingerprint", "peaks"):
        if key not in doc:
            raise ServesimError(f"{where}: missing top-level key '{key}'")
    missing = [k for k in FINGERPRINT_KEYS if k not in (doc["fingerprint"] or {})]
    if missing:
        raise ServesimError(f"{where}: fingerprint: missing {', '.join(missing)}")
    for k in ("bf16_tflops", "mem_bw_gbps"):
        if not isinstance((doc["peaks"] or {}).get(k), (int, float)):
            raise ServesimError(f"{where}: peaks.{k}: expected a number")
    for section, keys in ROW_KEYS.items():
        rows = doc.get(section)
        if rows is None:
            raise ServesimError(f"{where}: missing section '{section}' (a list, may be empty)")
        if not isinstance(rows, list):
            raise ServesimError(f"{where}: {section}: expected a list of rows")
        for i, row in enumerate(rows):
            absent = [k for k in keys if k not in (row or {})]
            if absent:
                raise ServesimError(f"{where}: {section}[{i}]: missing {', '.join(absent)}")
            for k in ("triton_s", "vendor_s", "seconds"):
                v = row.get(k)
                if v is not None and not (isinstance(v, (int, float)) and v > 0):
                    raise ServesimError(f"{where}: {section}[{i}].{k}: expected seconds > 0 "
                                        f"or null, got {v!r}")
    return doc


def _validate_v2(doc: dict, where: str) -> dict:
    """Version 2 (curves per row, all families optional): the cost model's reader parses every
    row, so what validates here loads there."""
    from servesim.costmodels.calibration import FAMILIES, Calibration

    for key in ("gpu", "peaks"):
        if key not in doc:
            raise ServesimError(f"{where}: missing top-level key '{key}'")
    for k in ("bf16_tflops", "mem_bw_gbps"):
        if not isinstance((doc["peaks"] or {}).get(k), (int, float)):
            raise ServesimError(f"{where}: peaks.{k}: expected a number")
    if not any(doc.get(f) for f in FAMILIES):
        raise ServesimError(f"{where}: no rows in any of {', '.join(FAMILIES)}")
    Calibration(Path(where), doc, None)
    return doc


def read_calibration(path: Path) -> dict:
    """A calibration file (YAML or JSON), validated."""
    from servesim.costmodels.calibration import read_doc

    path = Path(path)
    if not path.is_file():
        raise ServesimError(f"{path}: no such calibration file")
    return validate_calibration(read_doc(path, cached=False), str(path))


class _Dumper(yaml.SafeDumper):
    pass


def _flat(v) -> bool:
    return not isinstance(v, (dict, list)) or (isinstance(v, list) and all(
        not isinstance(x, (dict, list)) for x in v))


def _represent_dict(dumper, data):
    flow = all(_flat(v) for v in data.values()) and len(data) > 1
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flow)


def _represent_list(dumper, data):
    flow = bool(data) and all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(dict, _represent_dict)
_Dumper.add_representer(list, _represent_list)


def dump_calibration(doc: dict, fmt: str = "yaml") -> str:
    """YAML (or JSON) text: sections in schema order, one row per line."""
    if fmt != "json":
        return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100000,
                         allow_unicode=False)
    import json

    def one(v) -> str:
        return json.dumps(v, separators=(", ", ": "))

    lines = ["{"]
    for i, (k, v) in enumerate(doc.items()):
        end = "," if i < len(doc) - 1 else ""
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            rows = [f"    {one(r)}," for r in v]
            rows[-1] = rows[-1][:-1]
            lines += [f"  {json.dumps(k)}: [", *rows, f"  ]{end}"]
        elif isinstance(v, dict) and any(isinstance(x, dict) for x in v.values()):
            rows = [f"    {json.dumps(kk)}: {one(vv)}," for kk, vv in v.items()]
            rows[-1] = rows[-1][:-1]
            lines += [f"  {json.dumps(k)}: {{", *rows, f"  }}{end}"]
        else:
            lines.append(f"  {json.dumps(k)}: {one(v)}{end}")
    return "\n".join(lines + ["}", ""])


def check_output_file(path: Path, example: str = "GPU.yaml") -> None:
    """Refuse (one-line ServesimError) an output file that cannot be written: a folder, a name
    under a file, or a folder this user cannot write in. ``simulate calibrate`` checks ``-o``
    with it before measuring (minutes on the GPU)."""
    path = Path(path)
    if path.is_dir():
        raise ServesimError(f"{path}: is a folder; give the calibration file's name, e.g. "
                            f"{path / example}")
    if not path.name or path.name in (".", ".."):
        raise ServesimError(f"{path}: expected a file name")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ServesimError(f"{path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ServesimError(f"{path}: cannot write in {parent} (permission denied)")


def write_calibration(doc: dict, path: Path) -> Path:
    """Validate and write atomically (temp file + rename)."""
    path = Path(path)
    validate_calibration(doc, str(path))
    check_output_file(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ServesimError(f"{path}: cannot create its folder: {e.strerror or e}") from None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dump_calibration(doc, "json" if path.suffix == ".json" else "yaml"))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a data file is world-readable
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def new_document(gpu: str, fingerprint: dict, peaks: dict) -> dict:
    """An empty measured calibration document (schema version 2: rows are points, each with
    ``seconds`` and the ``kernel`` it was: vLLM's own attention kernel where it was measured,
    else the faster of ``triton_s`` and ``vendor_s``)."""
    return {"version": 2, "gpu": gpu, "fingerprint": fingerprint, "peaks": peaks,
            "source": {"kind": "measured", "tool": "simulate calibrate"},
            "memcpy": [], "gemm": [], "decode_attention": [], "prefill_attention": [],
            "allreduce": [], "moe": []}

