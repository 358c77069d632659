"""What-if planning from the command line: the tiered plan of a model on a hardware preset, and
with a target throughput the fewest hosts of four kinds (HBM+DRAM only, plus byte SCM, plus
block SCM, plus both) that reach it.

Usage::

    python -m apps.dlrm.whatif --model whatif_multi_tb --hardware gpu_pmem_nvme \\
        --target-throughput 1000000 --batch-size 4096

``--model`` names a file in ``conf/model`` and ``--hardware`` a preset (shipped in
``torchrec_mtrains/conf/hardware``, or a file of the app's ``conf/hardware``); further Hydra
overrides may follow (e.g. ``hardware.dram.capacity=2TiB planner.overlap_tier_io=true``), and
every ``planner.*`` key means what it means to the app (``planner.dram_budget=64GB``, or
``planner=tiered_capacity_bound``). The planner is the tiered one with the hardware's capacities
unless a ``planner=`` preset is named; ``planner=size_rule`` is refused, as it models nothing.
Tables are named as the DLRM app names them (``t_cat_<i>``); their access statistics come from
``--profile`` where it covers them, else from the model's ``zipf_exponents``, else the uniform
fallback, and the printout says which; ids per sample come from ``model.pooling_factors`` or
``data.pooling_factors``, as in the app.

``--launch SCHEDULER`` ends the printout with the torchx command that trains the model on the
hosts found (``-j <hosts>x<ranks per host>``, the preset, the planner and its budgets per host,
the batch size, the overrides given here), e.g. ``--launch slurm``; ``torchx run --dryrun ...``
shows the job it would submit.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from apps.dlrm.config import CONF_DIR, to_app_config
from apps.dlrm.errors import ConfigError
from apps.dlrm.model import pooling_factors
from torchrec_mtrains.planner.planners import with_budgets
from torchrec_mtrains.planner.presets import available_presets
from torchrec_mtrains.planner.sizes import exact_size, format_size, parse_size
from torchrec_mtrains.planner.topology import HostTopology
from torchrec_mtrains.planner.types import PlacementError, PlannerConfig
from torchrec_mtrains.planner.whatif import (
    compare_host_types,
    format_host_counts,
    host_variants,
    min_hosts,
    model_tables,
    plan_model,
)
from torchrec_mtrains.profiler.types import AccessProfile

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m apps.dlrm.whatif",
        description="Plan a model's embedding tables onto a memory hierarchy; with "
        "--target-throughput, compare how many hosts four host types need.",
    )
    p.add_argument("--model", required=True, help="model config name (conf/model/<name>.yaml)")
    p.add_argument("--hardware", required=True, help="hardware preset (see --help's list)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per rank per step")
    p.add_argument("--target-throughput", type=float, default=None, help="samples/s, whole job")
    p.add_argument("--hosts", type=int, default=None, help="plan on this many hosts")
    p.add_argument("--profile", default=None, help="access profile JSON")
    p.add_argument("--max-hosts", type=int, default=4096)
    p.add_argument(
        "--launch",
        metavar="SCHEDULER",
        default=None,
        help="print the torchx command that trains the model on the hosts found, for this "
        "scheduler (local_cwd, slurm, kubernetes, ...)",
    )
    p.add_argument("--conf-dir", default=str(CONF_DIR), help="Hydra config directory")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. planner.cache_steps=64")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from hydra import compose, initialize_config_dir

    conf = Path(args.conf_dir).resolve()
    hardware = sorted({*available_presets(), *(p.stem for p in (conf / "hardware").glob("*.yaml"))})
    if args.hardware not in hardware:
        print(
            f"unknown hardware {args.hardware!r}; available: {', '.join(hardware)}", file=sys.stderr
        )
        return 2
    models = sorted(p.stem for p in (conf / "model").glob("*.yaml"))
    if args.model not in models:
        print(f"unknown model {args.model!r}; available: {', '.join(models)}", file=sys.stderr)
        return 2
    # The tiered planner with the hardware's capacities unless a planner preset is named.
    chosen = [o for o in args.overrides if o.split("=", 1)[0].lstrip("+") == "planner"]
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                f"model={args.model}",
                f"hardware={args.hardware}",
                *([] if chosen else ["planner=tiered"]),
                *args.overrides,
            ],
        )
    try:
        app = to_app_config(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not isinstance(app.planner, PlannerConfig):
        print(
            f"error: {chosen[-1] if chosen else 'planner'}: the what-if CLI plans with the tiered "
            "planner only; choose planner=tiered or planner=tiered_capacity_bound",
            file=sys.stderr,
        )
        return 2
    host, config = app.hardware, app.planner
    try:
        profile_path = args.profile or config.profile
        profile = AccessProfile.from_json(profile_path) if profile_path else None
        model_spec = dataclasses.asdict(app.model)
        model_spec["pooling_factors"] = pooling_factors(app.model, app.data) or None
        model = model_tables(model_spec, profile)
        # The planner applies the budgets wherever it runs; applying them here first turns a
        # bad one (unparsable, or a byte SCM budget without byte SCM) into a one-line error.
        host = with_budgets(host, config.dram_budget, config.byte_scm_budget)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    batch = args.batch_size or app.data.batch_size

    print(
        f"model {args.model}: {len(model.configs)} tables, "
        f"{format_size(model.total_bytes)} of fp32 weights; hardware {host.name}: "
        f"{host.description}"
    )
    start = time.perf_counter()
    hosts = args.hosts
    if hosts is None:
        found = min_hosts(model, host, batch, None, config=config, max_hosts=args.max_hosts)
        if found.hosts is None:
            print(f"the tables fit on no number of {host.name} hosts up to {args.max_hosts}")
            return 1
        hosts = found.hosts
        print(f"fewest {host.name} hosts the tables fit on: {hosts}")
    try:
        _, summary = plan_model(model, host, hosts, batch, profile=profile, config=config)
    except PlacementError as e:
        print(str(e))
        return 1
    print(summary.format())
    launch_host, launch_hosts, host_type = host, hosts, host.name
    if args.target_throughput:
        print()
        counts = compare_host_types(
            model,
            host,
            batch,
            args.target_throughput,
            config=config,
            max_hosts=args.max_hosts,
        )
        print(format_host_counts(counts, args.target_throughput))
        # The launch takes the host type that reaches the target on the fewest hosts (the
        # first listed, with the fewest tiers, on a tie).
        reached = [(c.hosts, i) for i, c in enumerate(counts) if c.hosts is not None]
        if reached:
            launch_hosts, best = min(reached)
            host_type, launch_host = host_variants(host)[best]
    print(f"\n(planned in {time.perf_counter() - start:.1f} s)")
    if args.launch:
        planner = [] if chosen else ["planner=tiered"]
        command = launch_command(
            args.launch,
            args.model,
            args.hardware,
            launch_host,
            launch_hosts,
            batch,
            [*planner, *args.overrides],
            dropped=[t for t in _STORAGE if getattr(host, t) and not getattr(launch_host, t)],
        )
        print(
            f"\nto train on {launch_hosts} {host_type} host{'s' if launch_hosts > 1 else ''} "
            f"({args.hardware}; torchx run --dryrun ... shows the job):\n{command}"
        )
    return 0


_STORAGE = ("byte_scm", "block_scm")


def launch_command(
    scheduler: str,
    model: str,
    hardware: str,
    host: HostTopology,
    hosts: int,
    batch_size: int,
    overrides: Sequence[str],
    dropped: Sequence[str] = (),
) -> str:
    """The torchx command that trains ``model`` on ``hosts`` hosts of ``host``'s kind: one
    rank per GPU (else the preset's ``ranks_per_host``), the preset ``hardware`` without the
    storage tiers in ``dropped`` (``hardware.<tier>=null``), the planner's budgets per host as
    the what-if planned with them, then ``overrides``."""
    ranks = host.gpu.count if host.gpu is not None else host.ranks_per_host
    usable = parse_size(host.dram.capacity) - parse_size(host.dram_reserved)
    args = ["torchx", "run", "-s", scheduler, "mtrains.dlrm", "-j", f"{hosts}x{ranks}"]
    if host.gpu is not None:
        args += ["--gpu", str(host.gpu.count)]
    args += [f"model={model}", f"hardware={hardware}", *(f"hardware.{t}=null" for t in dropped)]
    args.append(f"data.batch_size={batch_size}")
    args.append(f"planner.dram_budget={exact_size(usable)}")
    if host.byte_scm is not None:
        args.append(f"planner.byte_scm_budget={exact_size(parse_size(host.byte_scm.capacity))}")
    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}  # budgets given stay as given
    args = [a for a in args if a.split("=", 1)[0] not in given]
    return shlex.join([*args, *overrides])


if __name__ == "__main__":
    sys.exit(main())
