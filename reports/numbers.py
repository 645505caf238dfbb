"""Numbers for people, in every report table: thousands separators, a few significant digits,
units, never scientific notation (``12,660``, not ``1.266e+04``)."""

from __future__ import annotations

import math
from typing import Any


def human(v: Any, unit: str = "", digits: int = 3) -> str:
    """``v`` with ``digits`` significant digits (trailing zeros dropped) below 1,000 and as a
    whole number with thousands separators from 1,000 on; integers exactly (``1,234,567``);
    ``unit`` appended (``"12.5 ms"``, ``"85%"`` for unit ``"%"``). ""  for None/NaN/inf."""
    if v is None or isinstance(v, bool):
        return "" if v is None else ("yes" if v else "no")
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(f):
        return ""
    sep = "" if unit in ("%", "") or unit.startswith("/") else " "
    if f.is_integer() and abs(f) < 1e18:
        return f"{int(f):,}{sep}{unit}"
    a = abs(f)
    decimals = max(0, digits - 1 - math.floor(math.log10(a)))
    if a >= 1000 or abs(round(f, decimals)) >= 1000:
        s = f"{f:,.0f}"
    else:
        s = f"{f:.{decimals}f}"
        if "." in s:
            s = s.rstrip("0").rstrip(".")
    return f"{s}{sep}{unit}"

