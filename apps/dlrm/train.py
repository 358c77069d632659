"""Train and evaluate a DLRM whose large tables live on storage tiers.

Run ``python -m apps.dlrm.train`` (Hydra; override anything, e.g. ``run.steps=50``). Under
torchrun / ``torchx run -s local_cwd`` each process joins the job's group (NCCL on CUDA, gloo on
CPU) from the environment; alone, it forms a one-process group. ``main(cfg)`` is the testable
entry point: it checks the composed config and converts it once to the typed
:class:`~apps.dlrm.config.AppConfig` that a rank's run, a :class:`~apps.dlrm.trainer.Trainer`,
reads. Its parts: ``model`` (plan, sharded DLRM, optimizers), ``checkpoints``, ``report``
(evaluation, history, TensorBoard, summary) and ``errors``.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from apps.dlrm.cluster import check_shared_run_dir
from apps.dlrm.config import (
    CONF_DIR,
    AppConfig,
    RunConfig,
    SizeRulePlannerConfig,
    check_keys,
    to_app_config,
)
from apps.dlrm.errors import USER_ERRORS, ConfigError, one_paragraph
from apps.dlrm.placement import check_large_tables
from apps.dlrm.trainer import Trainer
from torchrec_mtrains.distributed.runtime import (
    end_process_group,
    failing_together,
    format_duration,
    init_process_group,
    resolve_device,
)

logger: logging.Logger = logging.getLogger("apps.dlrm.train")


def compute_device(run: RunConfig) -> torch.device:
    """``run.device`` (auto / cpu / cuda) as this rank's device: ``cuda:<LOCAL_RANK>`` on GPUs."""
    try:
        return resolve_device(run.device)
    except ValueError as e:
        raise ConfigError(f"run.{e}") from None


def _agree_run_dir(cfg: DictConfig, app: AppConfig, world: int) -> tuple[DictConfig, AppConfig]:
    """Every rank composes its own config, so a timestamped ``run.dir`` can differ between them:
    all ranks adopt rank 0's. A rank whose own differs converts its composed config again with
    rank 0's ``run.dir``, so that values interpolating it (a ``hardware.tier_root`` of
    ``${run.dir}/tiers``) follow it too; this is why the composed config is still needed here."""
    if world == 1:
        return cfg, app
    chosen: list[object] = [app.run.dir]
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] == app.run.dir:
        return cfg, app
    cfg = copy.deepcopy(cfg)
    cfg.run.dir = chosen[0]
    return cfg, to_app_config(cfg)


def _saved_config(cfg: DictConfig) -> str:
    """The run directory's ``config.yaml``: the composed config, resolved. It is written from
    the composed config rather than the typed one, whose YAML would also hold what the schemas'
    checks derive (a block tier's ``access_bytes`` set to its block size), so the file reads as
    the presets and the command line set the options."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def _prepare_run_dir(run: RunConfig) -> Path:
    run_dir = Path(run.dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"run.dir={run_dir} is not writable ({e.strerror}). The run writes its plan, "
            "metrics, checkpoints and tier files there: pass run.dir=<a writable directory>."
        ) from None
    return run_dir


def main(cfg: DictConfig) -> dict[str, Any]:
    """Trains ``run.epochs`` passes over the training data (at most ``run.steps`` steps),
    evaluates on the held-out data, writes ``metrics.json``, ``history.jsonl`` and TensorBoard
    events; returns the metrics.

    Raises:
        ConfigError: for a configuration the user must fix (bad value, missing file,
            unwritable ``run.dir``, a run directory that already holds a run).
        RankFailure: when another rank failed, stopped answering for ``run.collective_timeout``
            or died; it names that rank (and its error).
    """
    check_keys(cfg)
    app = to_app_config(cfg)
    threads = app.run.num_threads
    caller_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    timeout = app.run.collective_timeout_duration
    group = init_process_group(compute_device(app.run), timeout)
    # A rank that fails, stalls or dies ends every rank, each naming it (see failing_together).
    timeout_option = f"run.collective_timeout={format_duration(timeout)}"
    try:
        with failing_together(timeout, option=timeout_option):
            if isinstance(app.planner, SizeRulePlannerConfig):  # before anything is written
                check_large_tables(app.planner.large_tables_choice, group.device.type)
            cfg, app = _agree_run_dir(cfg, app, group.world_size)
            run_dir = _prepare_run_dir(app.run)
            # Before any tier file is made: a run.dir a node does not share stops every rank.
            check_shared_run_dir(run_dir, group.rank, group.world_size)
            saved = _saved_config(cfg)
            return Trainer(app, run_dir, group.rank, group.world_size, group.device, saved).run()
    finally:
        if group.created:  # (failing_together has aborted it after an error)
            end_process_group()
        torch.set_num_threads(caller_threads)


def _exit_with(error: BaseException) -> NoReturn:
    if os.environ.get("MTRAINS_TRACEBACK") == "1":
        raise error
    print(f"error: {one_paragraph(error)}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")  # type: ignore[untyped-decorator]  # Hydra is not followed
def _hydra_main(cfg: DictConfig) -> None:
    try:
        main(cfg)
    except USER_ERRORS as e:
        # Exiting here, not in run(), keeps Hydra from adding its "Error executing job" line.
        _exit_with(e)


def _quiet_libraries() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("apps").setLevel(logging.INFO)
    # The checkpoints' chain says what each checkpoint holds and how large it is.
    logging.getLogger("torchrec_mtrains.checkpoint").setLevel(logging.INFO)
    # Known, harmless deprecation notes from TorchRec's DMP on this stack.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")
    # torchrec.metrics syncs through torchmetrics, which calls collectives torch now renames.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@record
def run() -> None:
    """Command-line entry point: Hydra composes the config, :func:`main` runs it.

    Configuration errors (ours, Hydra's and OmegaConf's) print as one ``error:`` paragraph and
    exit with status 2; ``HYDRA_FULL_ERROR=1`` shows their tracebacks instead."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ["MTRAINS_TRACEBACK"] = "1"
    # Let composition errors reach us instead of Hydra printing a trimmed traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    _quiet_libraries()
    try:
        _hydra_main()
    except USER_ERRORS as e:
        _exit_with(e)


if __name__ == "__main__":
    run()
