"""The plan a run was taken with, recorded in ``plan.json``: each table's tier, shards and ranks,
each rank's tier files, the device and world size. A resume compares the new plan with it (a
changed plan is refused by name, or rebuilt with ``run.replan``), and the tier files it names
are the ones a restart in place may remove."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchrec.distributed.types import ParameterSharding

from apps.dlrm.model import build_storage
from apps.dlrm.run_files import PLAN_FILE, tier_dir
from torchrec_mtrains.checkpoint.storage import write_private
from torchrec_mtrains.distributed import TieredParameterSharding
from torchrec_mtrains.distributed.options import tier_file_name
from torchrec_mtrains.distributed.virtual_tables import physical_rows
from torchrec_mtrains.planner import HostTopology
from torchrec_mtrains.types import RowLayout

logger: logging.Logger = logging.getLogger(__name__)


def _where(ps: ParameterSharding) -> str:
    if isinstance(ps, TieredParameterSharding):
        return str(ps.tier_options.tier.value)
    return "device memory"  # DRAM or HBM: the checkpoint restores either


def _shards(ps: ParameterSharding) -> list[list[Any]]:
    """``[offsets, sizes, rank]`` of each shard; a virtual table's in its store's rows (its
    tier files hold its ``max_live_rows``, not its id space)."""
    spec = getattr(ps, "sharding_spec", None)
    out: list[list[Any]] = []
    for shard in getattr(spec, "shards", None) or []:
        place = shard.placement
        out.append(
            [list(shard.shard_offsets), list(shard.shard_sizes), place.rank() if place else None]
        )
    bound = ps.tier_options.max_live_rows if isinstance(ps, TieredParameterSharding) else None
    if bound is not None and out:
        out.sort(key=lambda s: tuple(s[0]))
        ids = max(o[0] + z[0] for o, z, _ in out)
        extents = physical_rows([(o[0], z[0]) for o, z, _ in out], bound, ids)
        for shard, (first, rows) in zip(out, extents):
            shard[0][0], shard[1][0] = first, rows
    return out


def plan_record(
    hardware: HostTopology,
    run_dir: Path,
    plan: Mapping[str, ParameterSharding],
    world: int,
    device_type: str,
) -> dict[str, Any]:
    """What of a sharding plan the checkpoints and tier files depend on: per table its place
    (a tier, or device memory), sharding and shards, each rank's tier file paths, and the
    device type it was planned for."""
    tables: dict[str, Any] = {}
    files: dict[str, list[str]] = {str(r): [] for r in range(world)}
    storage = build_storage(hardware, run_dir, resume=True)
    for name, ps in sorted(plan.items()):
        shards = _shards(ps)
        tables[name] = {
            "where": _where(ps),
            "sharding_type": ps.sharding_type,
            "ranks": list(ps.ranks or []),
            "shards": shards,
        }
        if isinstance(ps, TieredParameterSharding):
            tier = ps.tier_options.tier
            store = storage.store_for(tier).name
            for offsets, _, shard_rank in shards:
                if shard_rank is None:
                    continue
                file = tier_file_name(name, offsets[0], offsets[1], store)
                files.setdefault(str(shard_rank), []).append(
                    str(tier_dir(hardware, run_dir, tier.value, shard_rank) / file)
                )
    return {"world_size": world, "device": device_type, "tables": tables, "files": files}


def virtual_tier_files(
    hardware: HostTopology, run_dir: Path, plan: Mapping[str, ParameterSharding], rank: int
) -> list[Path]:
    """This rank's tier files of the plan's virtual tables that exist. A resume builds them
    anew: which ids their rows hold is kept in the checkpoint, not with the files."""
    virtual = {
        name: ps
        for name, ps in plan.items()
        if isinstance(ps, TieredParameterSharding) and ps.tier_options.max_live_rows is not None
    }
    record = plan_record(hardware, run_dir, virtual, rank + 1, "cpu")
    return [Path(f) for f in record["files"].get(str(rank), []) if Path(f).exists()]


def tier_space_problem(
    hardware: HostTopology,
    run_dir: Path,
    plan: Mapping[str, ParameterSharding],
    rank: int,
    state_width: int = 1,
) -> str | None:
    """Why this rank's tier files of ``plan`` would not fit their file systems (they are
    preallocated in full when created; files already there are not counted), or None.
    ``state_width`` is the optimizer state's floats per row (row-wise Adagrad: 1)."""
    need: dict[int, tuple[Path, int]] = {}
    storage = build_storage(hardware, run_dir, resume=True)
    for name, ps in plan.items():
        if not isinstance(ps, TieredParameterSharding):
            continue
        tier = ps.tier_options.tier
        store = storage.store_for(tier)
        directory = tier_dir(hardware, run_dir, tier.value, rank)
        for offsets, sizes, shard_rank in _shards(ps):
            file = directory / tier_file_name(name, offsets[0], offsets[1], store.name)
            if shard_rank != rank or file.exists():
                continue
            existing = next(p for p in (directory, *directory.parents) if p.exists())
            device = existing.stat().st_dev
            _, total = need.get(device, (existing, 0))
            layout = RowLayout(num_rows=sizes[0], dim=sizes[1], state_width=state_width)
            need[device] = (existing, total + store.file_bytes(layout, storage.options_for(tier)))
    for existing, total in need.values():
        free = shutil.disk_usage(existing).free
        if total > free:
            return (
                f"the tier files of rank {rank} need {total / 2**20:.1f} MiB on the file system "
                f"of {existing} but {free / 2**20:.1f} MiB are free (found before creating "
                "any): free space there, point hardware.tier_root / hardware.dirs (or run.dir) "
                "at a larger device, or move tables to DRAM with a larger planner.dram_budget."
            )
    return None


def recorded_files(run_dir: Path) -> dict[str, list[str]]:
    try:
        record = json.loads((run_dir / PLAN_FILE).read_text())
        return {str(k): [str(p) for p in v] for k, v in record["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def save_plan(run_dir: Path, record: Mapping[str, Any]) -> None:
    """Writes the plan record (rank 0), before any tier file exists."""
    write_private(run_dir / PLAN_FILE, json.dumps(record, indent=1) + "\n")


def plan_changes(run_dir: Path, record: Mapping[str, Any]) -> str | None:
    """How ``record`` differs from the plan the run directory's checkpoints were taken with,
    or None (also when the directory predates plan records).

    Only what the checkpoint and the tier files depend on counts: a table's tier, sharding and
    shards. Cache sizes and policies may change on resume. So may a table's move between
    device memory and a tier when the run changed device (CUDA to CPU: the planner plans for
    the device); the checkpoint fills the table wherever it now is, which is logged."""
    path = run_dir / PLAN_FILE
    try:
        saved = json.loads(path.read_text())
        before: dict[str, Any] = saved["tables"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now: dict[str, Any] = dict(record["tables"])
    moved_device = saved.get("device", record.get("device")) != record.get("device")
    changes: list[str] = []
    for name in sorted(set(before) | set(now), key=_table_order):
        old, new = before.get(name), now.get(name)
        if old is None or new is None:
            changes.append(f"table {name} {'is new' if old is None else 'is gone'}")
        elif old["where"] != new["where"]:
            change = f"table {name} was on {old['where']}, now {new['where']}"
            if moved_device and "device memory" in (old["where"], new["where"]):
                logger.warning(
                    "%s (planned for %s, now %s): loading it from the checkpoint",
                    change,
                    saved.get("device"),
                    record.get("device"),
                )
                continue
            changes.append(change)
        elif (old["sharding_type"], old["ranks"], old["shards"]) != (
            new["sharding_type"],
            new["ranks"],
            new["shards"],
        ):
            changes.append(
                f"table {name} was sharded {old['sharding_type']} on ranks {old['ranks']}, now "
                f"{new['sharding_type']} on ranks {new['ranks']}"
                + ("" if old["ranks"] != new["ranks"] else " with other shard bounds")
            )
    if not changes:
        return None
    shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
    return (
        f"the plan changed since the checkpoint: {shown}. The checkpoint's tier files follow "
        f"{path}: resume with the planner, hardware and model options that made it (saved in "
        f"{run_dir / 'config.yaml'}), pass run.replan=true to rebuild every tier file from the "
        "checkpoint under the new plan, or start a new run.dir."
    )


def planned_world_size(run_dir: Path) -> int | None:
    """The world size of the plan the run directory's checkpoints were taken with, if known."""
    try:
        return int(json.loads((run_dir / PLAN_FILE).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def drop_old_tier_files(run_dir: Path, rank: int, world: int) -> list[str]:
    """Removes the tier files of the plan recorded in ``run_dir`` that this rank owns under the
    new plan's world size: its own, and on rank 0 those of ranks beyond it. Rank ``r`` only
    touches rank ``r``'s directories (and rank 0 those no new rank uses), so no rank removes a
    file another has just created. Safe only before loading a finished checkpoint, which holds
    every row. Returns the removed paths."""
    removed = []
    for owner, paths in recorded_files(run_dir).items():
        if int(owner) != rank and not (rank == 0 and int(owner) >= world):
            continue
        for path in map(Path, paths):
            if path.exists():
                path.unlink()
                removed.append(str(path))
    return removed


def _table_order(name: str) -> tuple[str, int]:
    stem, _, number = name.rpartition("_")
    return (stem, int(number)) if number.isdigit() else (name, -1)
