"""A tiny DLRM for the app's tests, and composing the app's config around it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from apps.dlrm.config import CONF_DIR
from torchrec_mtrains.distributed.incremental import ROWS_PREFIX
from torchrec_mtrains.tiers import FileHeader, open_store
from torchrec_mtrains.tiers.base import FILE_SUFFIX, HEADER_BYTES
from torchrec_mtrains.types import RowLayout

# 26 tables: 20 of 100 rows (6.8 KB each with row-wise optimizer state) fit the 200 KB DRAM
# budget; the 2,000-row tables (136 KB) go to byte SCM, the 4,000-row ones (272 KB) to block SCM.
SIZES = [4000, 2000] + [100] * 20 + [4000, 2000, 4000, 2000]
TIERED_TABLES = 6
TINY_TABLES = [
    f"model.num_embeddings_per_feature=[{','.join(map(str, SIZES))}]",
    "planner=size_rule",
    "planner.dram_budget=200KB",
    "planner.block_scm_min_bytes=200KB",
    "planner.cache_load_factor=0.25",
    "run.progress=false",
    "hardware.block_scm.max_pass_bytes=65536",  # a tiny model's I/O passes (planned DRAM)
]


def compose_app(*overrides: str) -> DictConfig:
    """The app's config (``conf/config.yaml``) with ``overrides``."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def app_config(run_dir: Path, *overrides: str) -> DictConfig:
    """The tiny model's config writing to ``run_dir``."""
    return compose_app(*TINY_TABLES, f"run.dir={run_dir}", *overrides)


def tier_rows(path: Path) -> np.ndarray:  # type: ignore[type-arg]
    """Every row of a tier file, in id order, read through its store (a log-structured file's
    bytes depend on the order rows were written in; its rows do not)."""
    with path.open("rb") as f:
        raw = f.read(HEADER_BYTES)
    header = FileHeader.unpack(raw, path)
    layout = RowLayout(header.num_rows, header.dim, header.state_width, header.dtype)
    table = path.name[: -len(f".{header.tier}{FILE_SUFFIX}")]
    with open_store(header.tier, path.parent, table, layout, mode="open") as store:
        return store.read_range(0, layout.num_rows)


def same_tier_rows(left: Path, right: Path) -> bool:
    """Whether two tier files hold the same rows, bit for bit."""
    return bool(np.array_equal(tier_rows(left), tier_rows(right)))


def checkpoint_weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every embedding table's full weight in ``checkpoint``, whatever the plan that wrote it:
    dcp's tensors, and the log-structured tables' rows (ids and whole rows, batch by batch)
    put back in id order."""
    scratch.mkdir(parents=True, exist_ok=True)
    flat = scratch / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, flat)
    saved = torch.load(flat, weights_only=False)
    out = {
        key: value
        for key, value in saved["model"].items()
        if ".embedding_bags." in key and key.endswith(".weight")
    }
    for key, layout in saved.items():
        if not (key.startswith(ROWS_PREFIX) and key.endswith("::layout")):
            continue
        path, where, _ = key[len(ROWS_PREFIX) :].split("::", 2)
        row, rows, col, cols = (int(x) for x in where.split(":"))
        name = path.split("/", 1)[1]
        base = key[: -len("layout")]
        columns = next(c for p, c, *_ in json.loads(layout) if p == path)
        parts = [k for k in saved if k.startswith(base) and k.endswith("::rows")]
        table = out.setdefault(name, torch.full((0, 0), float("nan")))
        shape = (max(table.shape[0], row + rows), max(table.shape[1], col + cols))
        if table.shape != shape:
            grown = torch.full(shape, float("nan"))
            grown[: table.shape[0], : table.shape[1]] = table
            out[name] = table = grown
        for part in parts:
            ids = saved[part[: -len("rows")] + "ids"]
            table[ids, col : col + cols] = saved[part][:, columns : columns + cols]
    return out
