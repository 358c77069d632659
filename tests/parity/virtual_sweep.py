"""The sweep's virtual-table axis: drawn virtual-table configurations against FUSED.

Each case (:class:`tests.distributed.virtual_harness.VirtualCase`) draws the id space (2**20 to
2**50 ids, 2 to 8 buckets), the sharding (table- or row-wise), the world size (1 or 2), the
store (every tier and layout), EBC or EC (weighted or not), the optimizer, the cache size and
policy, the bound on live rows, the eviction policy with its trigger, whether both models
evaluate batches between training steps (outputs compared; no id only evaluated may hold a live
row), and whether the model is replaced midway by one loaded from its state dicts (module and optimizer, in either order) or
restored from a checkpoint chain (a full link, then incremental ones), and is compared step by step with a FUSED table of the rows its ids stand for (see the harness).

Run it::

    python -m tests.parity.sweep --virtual --sweep 1000 --seed 0

A case whose new ids do not fit its bound even after eviction is refused by the table itself
(``VirtualTableFullError``, a one-line error naming the table): counted apart, not as a pass.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.distributed.virtual_harness import (
    BATCH,
    MAX_LEN,
    REF_ROWS,
    VirtualCase,
    run_case,
    spawn_cases,
)
from tests.parity.two_ranks import run_in_two_rank_jobs
from torchrec_mtrains.distributed.virtual_tables import bucket_rows

STORES = ("dram", "byte_scm", "block_scm", "log_block_scm")
EVICTIONS = ("none", "count", "ttl", "mixed", "l2", "score")
FULL = "VirtualTableFullError"


def draw_virtual_case(rng: random.Random, seed: int) -> VirtualCase:
    world = rng.choice((1, 1, 2))
    sharding = rng.choice(("tw", "rw")) if world == 2 else "tw"
    kind = rng.choice(("ebc", "ebc", "ec"))
    buckets = rng.choice((2, 3, 4, 6, 8)) if sharding == "rw" else 4
    power = rng.choice((20, 32, 40, 50))
    num_embeddings = buckets * 2 ** (power - 3) if sharding == "rw" else 2**power
    eviction = rng.choice(EVICTIONS)
    # Ids each rank's store must hold at most without eviction, and its share of the bound.
    if sharding == "rw":
        shares = [r / num_embeddings for r in bucket_rows(num_embeddings, buckets, 2)]
        needed = math.ceil((REF_ROWS // 2) / min(shares))
    else:
        needed = REF_ROWS
    max_live_rows = needed + rng.randint(0, 40)
    if eviction != "none":
        max_live_rows = rng.randint(2 * needed // 3, max_live_rows)
    trigger = rng.choice((0, 0, rng.randint(20, 120)))
    capacity_low = max_live_rows * (min(shares) if sharding == "rw" else 1.0)
    batch_rows = 2 * BATCH * MAX_LEN * world  # a step's ids of the table on a rank, at most
    factor = max(rng.uniform(0.1, 1.0), min(1.0, (batch_rows + 4) / capacity_low))
    steps = rng.randint(8, 20)
    return VirtualCase(
        store=rng.choice(STORES),
        kind=kind,
        sharding=sharding,
        optimizer=rng.choice(("sgd", "rowwise_adagrad", "adagrad")),
        weighted=kind == "ebc" and rng.random() < 0.3,
        num_embeddings=num_embeddings,
        buckets=buckets,
        max_live_rows=max_live_rows,
        cache_load_factor=round(factor, 4),
        policy=rng.choice(("lru", "lfu")),
        steps=steps,
        seed=seed,
        eviction=eviction,
        trigger=trigger,
        world_size=world,
        reload_at=rng.choice((0, 0, rng.randint(1, steps - 1))),
        optimizer_first=rng.random() < 0.5,
        reload_from=rng.choice(("state_dicts", "chain")),
        evaluate_every=rng.choice((0, 0, rng.randint(1, 5))),
    )


def draw_virtual_cases(count: int, seed: int) -> list[VirtualCase]:
    rng = random.Random(seed)
    return [draw_virtual_case(rng, seed * 1_000_003 + i) for i in range(count)]


def _first_line(error: str) -> str:
    """The exception line of a traceback (its last line that names an error)."""
    lines = [line for line in error.strip().splitlines() if "Error" in line or "error" in line]
    return lines[-1] if lines else error.strip().splitlines()[-1]


def _status(result: dict[str, Any]) -> str:
    if result["error"] is not None:
        return "refused" if FULL in result["error"] else "error"
    if result["mismatched_step"] is not None or result.get("untrained_live"):
        return "mismatch"
    return "ok"


def run_virtual(cases: Sequence[VirtualCase], root: Path) -> list[tuple[VirtualCase, str, str]]:
    """Each case's status (ok, mismatch, error, refused) and details, in order."""
    out: dict[int, tuple[VirtualCase, str, str]] = {}
    ones = [(i, c) for i, c in enumerate(cases) if c.world_size == 1]
    for i, case in ones:
        try:
            result = run_case(case, 0, 1, root / f"v{i}").as_dict()
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}", "mismatched_step": None}
        error = result.get("error")
        detail = (
            _first_line(error)
            if error
            else f"first mismatch {result['mismatched_step']}, "
            f"{result.get('untrained_live', 0)} live ids never trained"
        )
        out[i] = (case, _status(result), detail)

    def judge(results: list[dict[str, Any]]) -> tuple[str, str]:
        statuses = [_status(r) for r in results]
        # A table refusing a batch on one rank stops the other one mid-collective.
        order = ("refused", "error", "mismatch") if "refused" in statuses else ("error", "mismatch")
        worst = next((s for s in order if s in statuses), "ok")
        detail = " | ".join(
            f"rank {k}: " + _first_line(r["error"]) if r["error"] else f"rank {k}: ok"
            for k, r in enumerate(results)
        )
        return worst, detail

    twos = [(i, c) for i, c in enumerate(cases) if c.world_size == 2]
    out.update(run_in_two_rank_jobs(twos, lambda left: spawn_cases(left, 2, root), judge))
    return [out[i] for i in range(len(cases))]


def virtual_report(outcomes: Sequence[tuple[VirtualCase, str, str]]) -> tuple[str, list[str]]:
    counts = {s: sum(o[1] == s for o in outcomes) for s in ("ok", "mismatch", "error", "refused")}
    tried = len(outcomes) - counts["refused"]
    summary = (
        f"virtual sweep: {tried} configurations compared with TorchRec's FUSED kernel: "
        f"{counts['ok']} bit for bit, {counts['mismatch']} mismatched, {counts['error']} failed "
        f"({counts['refused']} refused by the table itself: new ids past max_live_rows)"
    )
    failures = [
        f"{status.upper()} {json.dumps(asdict(case))}\n  {detail[-600:]}"
        for case, status, detail in outcomes
        if status in ("mismatch", "error")
    ]
    return summary, failures
