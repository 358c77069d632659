"""Sizes as configs write them: a number with an SI or IEC unit (``"512GB"`` = 512e9 bytes, as on
datasheets; ``"24GiB"`` = 24 * 2**30) or a byte count, read the same way everywhere (hardware
presets, planner budgets, the what-if CLI)."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "PIB": 2**50,
}


def parse_size(value: str | int | float, what: str = "size") -> int:
    """``"512GB"`` -> 512e9, ``"24GiB"`` -> 24 * 2**30, ``1024`` -> 1024.

    Raises:
        ValueError: naming ``what`` when ``value`` is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not a size")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(
                f"{what}={value!r} is not a size; write e.g. 512GB (SI), 24GiB (IEC) or bytes"
            )
        number, unit = float(match.group(1)), match.group(2).upper()
    if number < 0 or not math.isfinite(number):
        raise ValueError(f"{what}={value!r} must be finite and >= 0")
    return int(number * _UNITS[unit])


def exact_size(num_bytes: int) -> str:
    """``num_bytes`` in the largest unit that holds it exactly, as :func:`parse_size` reads it
    back to the byte: ``2**40`` -> ``1TiB``, ``64 * 10**6`` -> ``64MB``, ``1000001`` -> ``1000001``."""
    if num_bytes > 0:
        for unit, size in sorted(_UNITS.items(), key=lambda item: -item[1]):
            if size > 1 and num_bytes % size == 0:
                return f"{num_bytes // size}{unit.replace('I', 'i')}"
    return str(num_bytes)


def format_size(num_bytes: float) -> str:
    """Bytes in IEC units with three significant digits, e.g. ``1.50 TiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
