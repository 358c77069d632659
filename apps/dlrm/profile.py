"""Profile the DLRM app's data: per-table access statistics for the tiered planner.

Composes the app's Hydra configs (``conf/``) with the overrides given on the command line,
streams the data source's batches through :func:`~torchrec_mtrains.profiler.profile_batches`
and writes the profile JSON and its PNG summary. Tables are named as the app names them
(``t_cat_<i>`` for feature ``cat_<i>``), shaped by ``model.num_embeddings_per_feature`` and
``model.embedding_dim``, so the planner can use the profile for the app's model.

Usage::

    python -m apps.dlrm.profile --out runs/profile data=synthetic data.num_batches=200
    # -> runs/profile.json, runs/profile.png
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from apps.dlrm.config import CONF_DIR, to_app_config
from torchrec_mtrains.profiler import (
    HitRateMethod,
    ProfilerConfig,
    TableInfo,
    plot_profile,
    profile_batches,
)

__all__ = ["main", "output_paths"]


def output_paths(out: str) -> tuple[Path, Path]:
    """``runs/p`` or ``runs/p.json`` -> (``runs/p.json``, ``runs/p.png``)."""
    path = Path(out)
    stem = path.with_suffix("") if path.suffix in (".json", ".png") else path
    return stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".png")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m apps.dlrm.profile",
        description="Profile the app's data source: writes <out>.json and <out>.png.",
    )
    p.add_argument("--out", default="runs/profile", help="output path prefix (or .json path)")
    p.add_argument("--sampling-rate", type=float, default=1.0, help="fraction of batches profiled")
    p.add_argument("--seed", type=int, default=0, help="batch sampling seed")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    p.add_argument(
        "--method",
        choices=[m.value for m in (HitRateMethod.EXACT, HitRateMethod.SHARDS)],
        default=HitRateMethod.EXACT.value,
        help="hit-rate curves: exact stack distances, or SHARDS sampling for long traces",
    )
    p.add_argument("--conf-dir", default=str(CONF_DIR), help="Hydra config directory")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.num_batches=200")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from hydra import compose, initialize_config_dir

    from apps.dlrm.data import build_dataloader

    with initialize_config_dir(config_dir=str(Path(args.conf_dir).resolve()), version_base=None):
        cfg = compose(config_name="config", overrides=list(args.overrides))
    app = to_app_config(cfg)
    sizes = app.model.num_embeddings_per_feature
    dims = app.model.embedding_dims or [app.model.embedding_dim] * len(sizes)
    tables = {
        f"t_cat_{i}": TableInfo(num_rows=n, dim=int(d)) for i, (n, d) in enumerate(zip(sizes, dims))
    }
    feature_to_table = {f"cat_{i}": f"t_cat_{i}" for i in range(len(sizes))}
    batches = build_dataloader(app.data, rank=0, world_size=1)
    if args.max_batches is not None:
        batches = itertools.islice(batches, args.max_batches)
    start = time.perf_counter()
    profile = profile_batches(
        batches,
        tables,
        sampling_rate=args.sampling_rate,
        seed=args.seed,
        feature_to_table=feature_to_table,
        config=ProfilerConfig(
            hit_rate_method=HitRateMethod(args.method), lookahead=app.pipeline.lookahead
        ),
    )
    json_path, png_path = output_paths(args.out)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(json_path)
    plot_profile(profile, png_path)
    print(
        f"profiled {profile.batches_profiled} of {profile.batches_seen} batches "
        f"({len(tables)} tables) in {time.perf_counter() - start:.1f} s"
    )
    print(f"{'table':<10}{'rows':>12}{'ids/sample':>12}{'unique':>8}{'max hit':>9}")
    for name in tables:
        t = profile[name]
        print(
            f"{t.name:<10}{t.num_rows:>12}{t.accesses_per_sample:>12.2f}"
            f"{t.unique_ratio:>8.3f}{t.max_hit_rate:>9.3f}"
        )
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
