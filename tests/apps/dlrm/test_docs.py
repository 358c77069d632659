"""The README's configuration reference says what the composed config holds: each default it
states is the value ``conf/`` gives (or the schema, for keys the YAML leaves to it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from dlrm_helpers import compose_app
from omegaconf import OmegaConf

README = Path(__file__).resolve().parents[3] / "README.md"
ROW = re.compile(r"^\| `([^`]+)`(?: / `([^`]+)`)? \| (`[^|]*`|[^|`]*) \|")


def _reference_rows() -> list[tuple[str, str]]:
    """(key, stated default) for each row of the configuration reference that states one."""
    text = README.read_text()
    table = text.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        match = ROW.match(line)
        if not match or "=" in match.group(1):
            continue
        keys = [k for k in match.group(1, 2) if k]
        defaults = re.findall(r"`([^`]*)`", match.group(3))
        if not defaults:
            continue  # "preset's": no one value
        stated = defaults if len(defaults) == len(keys) else defaults * len(keys)
        rows += list(zip(keys, stated, strict=True))
    return rows


def _as_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def test_the_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 300


def test_the_reference_table_states_enough_keys() -> None:
    assert len(_reference_rows()) >= 20


@pytest.mark.parametrize(("key", "stated"), _reference_rows())
def test_each_stated_default_is_the_composed_value(key: str, stated: str) -> None:
    cfg = compose_app()
    if key in ("model", "data", "planner", "hardware"):  # a group: its file is the default's
        assert compose_app(f"{key}={stated}")[key] == cfg[key], f"README: {key}={stated}"
    elif key == "run.dir":
        assert str(cfg.run.dir).startswith(stated.split("<", 1)[0])
    else:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
        assert _as_text(value) == stated, f"README: {key} defaults to {stated}, conf/: {value!r}"
