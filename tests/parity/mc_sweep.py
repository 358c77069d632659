"""The sweep's managed-collision axis: drawn configurations of TorchRec's managed-collision
modules over this project's sharder against the same modules over TorchRec's own (FUSED).

Each case (:class:`tests.distributed.mc_harness.MCCase`) draws EBC or EC, the store (every tier
and layout), the optimizer, the slots per rank, the cache's size and policy, the module's
eviction policy and interval, how many raw ids the batches draw from and how many a sample
holds, the steps, the world size (1 or 2) and the weights' dtype (fp32 or fp16); every step's
output, then the rows and the momentum, must be bit for bit the reference's (see the
harness).

Run it::

    python -m tests.parity.sweep --mc --sweep 300 --seed 0
"""

from __future__ import annotations

import json
import random
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.distributed.mc_harness import (
    BATCH,
    REMAP_POLICIES,
    STORES,
    MCCase,
    run_case,
    spawn_cases,
)
from tests.parity.two_ranks import run_in_two_rank_jobs


def draw_mc_case(rng: random.Random, seed: int) -> MCCase:
    world = rng.choice((1, 1, 2))
    zch_size = rng.choice((16, 24, 40, 64))
    max_len = rng.choice((1, 2, 3))
    # Ids a rank's shard can get in one step: a cache smaller than that could not hold a batch.
    at_once = min(zch_size, BATCH * max_len * world)
    factor = max(rng.uniform(0.2, 1.0), min(1.0, (at_once + 1) / zch_size))
    return MCCase(
        kind=rng.choice(("ebc", "ebc", "ec")),
        store=rng.choice(STORES),
        optimizer=rng.choice(("rowwise_adagrad", "rowwise_adagrad", "sgd", "adagrad")),
        zch_size=zch_size,
        cache_load_factor=round(factor, 4),
        cache_policy=rng.choice(("lru", "lfu")),
        remap_policy=rng.choice(REMAP_POLICIES),
        eviction_interval=rng.choice((1, 1, 2, 3, 5)),
        raw_ids=rng.choice((zch_size * world, 100, 300, 1000)),
        max_len=max_len,
        steps=rng.randint(10, 40),
        seed=seed,
        world_size=world,
        dtype=rng.choice(("fp32", "fp32", "fp16")),
    )


def draw_mc_cases(count: int, seed: int) -> list[MCCase]:
    rng = random.Random(seed)
    return [draw_mc_case(rng, seed * 1_000_003 + i) for i in range(count)]


def _status(result: dict[str, Any]) -> str:
    if result["error"] is not None:
        return "error"
    return "ok" if result["mismatched_step"] is None else "mismatch"


def _last_line(error: str) -> str:
    return error.strip().splitlines()[-1]


def run_mc(cases: Sequence[MCCase], root: Path) -> list[tuple[MCCase, str, str]]:
    """Each case's status (ok, mismatch, error) and details, in order."""
    out: dict[int, tuple[MCCase, str, str]] = {}
    for i, case in enumerate(cases):
        if case.world_size != 1:
            continue
        try:
            result = run_case(case, 0, root / f"m{i}")
        except Exception:
            result = {"error": traceback.format_exc(), "mismatched_step": None}
        error = result["error"]
        detail = _last_line(error) if error else f"first mismatch {result['mismatched_step']}"
        out[i] = (case, _status(result), detail)

    def judge(results: list[dict[str, Any]]) -> tuple[str, str]:
        statuses = [_status(r) for r in results]
        worst = next((s for s in ("error", "mismatch") if s in statuses), "ok")
        detail = " | ".join(
            f"rank {k}: " + (_last_line(r["error"]) if r["error"] else f"{r['mismatched_step']}")
            for k, r in enumerate(results)
        )
        return worst, detail

    twos = [(i, c) for i, c in enumerate(cases) if c.world_size == 2]
    out.update(run_in_two_rank_jobs(twos, lambda left: spawn_cases(left, root), judge))
    return [out[i] for i in range(len(cases))]


def mc_report(outcomes: Sequence[tuple[MCCase, str, str]]) -> tuple[str, list[str]]:
    counts = {s: sum(o[1] == s for o in outcomes) for s in ("ok", "mismatch", "error")}
    summary = (
        f"managed-collision sweep: {len(outcomes)} configurations compared with TorchRec's "
        f"FUSED kernel under TorchRec's managed-collision modules: {counts['ok']} bit for bit, "
        f"{counts['mismatch']} mismatched, {counts['error']} failed"
    )
    failures = [
        f"{status.upper()} {json.dumps(asdict(case))}\n  {detail[-600:]}"
        for case, status, detail in outcomes
        if status != "ok"
    ]
    return summary, failures
