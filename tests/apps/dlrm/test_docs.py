"""The README's configuration reference says what the composed config holds: each default it
states is the value ``conf/`` gives (or the schema, for keys the YAML leaves to it); and the
docs' training commands, as written, get a plan."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from dlrm_helpers import compose_app
from omegaconf import OmegaConf
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from apps.dlrm.config import to_app_config
from apps.dlrm.model import table_configs, table_sizes, tiered_plan
from torchrec_mtrains.distributed import TieredEmbeddingBagCollectionSharder, TierStorage
from torchrec_mtrains.planner import PlannerConfig

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


DOCS = [README, README.parent / "docs" / "app.md", README.parent / "conf" / "config.yaml"]
TRAIN = re.compile(r"python -m apps\.dlrm\.train((?: +[^\s#\\`]+)+)")


def _train_examples() -> list[tuple[str, list[str]]]:
    """(file, overrides) of each one-line ``apps.dlrm.train`` example in the docs that runs on
    the default synthetic data (an example reading a user's files or profile, or sweeping with
    ``--multirun``, is left out)."""
    out = []
    for path in DOCS:
        for line in path.read_text().splitlines():
            match = TRAIN.search(line)
            if match is None or line.rstrip().endswith("\\"):
                continue
            overrides = match.group(1).split()
            if any(
                o.startswith(("data=", "data.paths", "planner.profile", "-")) for o in overrides
            ):
                continue
            out.append((path.name, overrides))
    return out


def test_the_docs_show_train_examples() -> None:
    assert len(_train_examples()) >= 3


@pytest.mark.parametrize(("doc", "overrides"), _train_examples())
def test_each_train_example_plans(doc: str, overrides: list[str]) -> None:
    """A command of the docs, as written, gets a plan: its tables fit the budget it names."""
    app = to_app_config(compose_app(*overrides))
    if not isinstance(app.planner, PlannerConfig):
        pytest.skip("not the tiered planner")
    sizes = table_sizes(app.model, app.data)
    tables = table_configs(app.model, sizes, app.model.embedding_dim, app.run.seed)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = TieredEmbeddingBagCollectionSharder(TierStorage(), offer_tiered_kernel=True)
    plan, _ = tiered_plan(app, ebc, sharder, 1, torch.device("cpu"))
    assert plan, f"{doc}: {' '.join(overrides)}"
