"""The DLRM app end to end, in-process: Hydra-composed configs run through ``main(cfg)``.

Tables are tiny (a few thousand rows) and the DRAM budget small, so every run places tables on
all three tiers: DRAM (fused), byte SCM and block SCM.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from dlrm_helpers import SIZES, TIERED_TABLES, TINY_TABLES, app_config
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from apps.dlrm.config import to_app_config
from apps.dlrm.data import SyntheticCriteoDataset
from apps.dlrm.model import tiered_plan
from apps.dlrm.placement import (
    LargeTables,
    balance_ranks,
    format_placements,
    size_rule_plan,
    table_bytes,
)
from apps.dlrm.train import ConfigError, main, one_paragraph, run
from torchrec_mtrains.cache.policies import LRUPolicy, register_policy
from torchrec_mtrains.distributed import (
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TierStorage,
)
from torchrec_mtrains.pipeline import LookaheadTrainPipeline

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / "conf"

TINY = [*TINY_TABLES, "data.batch_size=64", "run.eval_batches=4"]


def config(run_dir: Path, *overrides: str) -> DictConfig:
    return app_config(run_dir, *TINY[len(TINY_TABLES) :], *overrides)


def read_metrics(run_dir: Path) -> dict[str, object]:
    metrics: dict[str, object] = json.loads((run_dir / "metrics.json").read_text())
    return metrics


def tier_inodes(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_ino for p in run_dir.glob("tiers/*/*/*.rows")}


def test_run_writes_plan_metrics_and_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    returned = main(config(run_dir, "run.steps=20"))

    metrics = read_metrics(run_dir)
    assert metrics["world_size"] == 1
    assert metrics["steps"] == 20
    assert returned["steps"] == 20
    loss = metrics["train_loss_last"]
    assert isinstance(loss, float) and math.isfinite(loss)
    auc = metrics["eval_auc"]
    assert isinstance(auc, float) and 0.0 <= auc <= 1.0
    hit = metrics["cache_hit_rate"]
    assert isinstance(hit, float) and 0.0 <= hit <= 1.0
    tables = metrics["tables"]
    assert isinstance(tables, dict) and len(tables) == TIERED_TABLES
    assert all(t["lookups"] > 0 and t["tier_bytes_read"] > 0 for t in tables.values())
    assert metrics["tier_files"] == {"created": TIERED_TABLES, "reopened": 0}

    plan = (run_dir / "plan.txt").read_text()
    for tier in ("dram", "byte_scm", "block_scm"):
        assert tier in plan
    assert len(list(run_dir.glob("tiers/byte_scm/rank0/*.rows"))) == 3
    assert len(list(run_dir.glob("tiers/block_scm/rank0/*.rows"))) == 3
    assert (run_dir / "checkpoints" / "step_00000020" / "DONE").exists()
    assert "run:" in (run_dir / "config.yaml").read_text()


def test_resume_continues_from_last_checkpoint_and_reopens_tiers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=12", "run.checkpoint_every=5"))
    done = sorted(p.parent.name for p in run_dir.glob("checkpoints/*/DONE"))
    assert done == ["step_00000005", "step_00000010", "step_00000012"]
    inodes = tier_inodes(run_dir)
    assert len(inodes) == TIERED_TABLES

    metrics = main(config(run_dir, "run.steps=20", "run.resume=true"))

    assert metrics["resumed_from_step"] == 12
    assert metrics["steps"] == 20
    assert read_metrics(run_dir)["steps"] == 20
    assert metrics["tier_files"] == {"created": 0, "reopened": TIERED_TABLES}
    assert tier_inodes(run_dir) == inodes
    assert (run_dir / "checkpoints" / "step_00000020" / "DONE").exists()


def test_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    """Stopping after a checkpoint and resuming gives the same model as never stopping: the
    data stream, the tiers and both optimizers' states all continue where they were."""
    straight = main(config(tmp_path / "straight", "run.steps=16"))
    # The first run "crashes" after its step-8 checkpoint: the later checkpoint is unfinished.
    main(config(tmp_path / "resumed", "run.steps=12", "run.checkpoint_every=8"))
    (tmp_path / "resumed" / "checkpoints" / "step_00000012" / "DONE").unlink()
    resumed = main(config(tmp_path / "resumed", "run.steps=16", "run.resume=true"))

    assert resumed["resumed_from_step"] == 8
    assert resumed["steps"] == straight["steps"] == 16
    assert resumed["train_loss_last"] == pytest.approx(straight["train_loss_last"], abs=1e-5)
    assert resumed["eval_auc"] == pytest.approx(straight["eval_auc"], abs=1e-5)
    assert resumed["eval_ne"] == pytest.approx(straight["eval_ne"], abs=1e-5)


def test_auc_rises_above_chance(tmp_path: Path) -> None:
    metrics = main(
        config(tmp_path / "run", "run.steps=50", "data.batch_size=256", "run.eval_batches=8")
    )
    auc, ne = metrics["eval_auc"], metrics["eval_ne"]
    assert isinstance(auc, float) and auc > 0.65
    assert isinstance(ne, float) and ne < 1.0


def test_rerun_into_a_used_run_dir_needs_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=2"))
    with pytest.raises(ConfigError, match=r"run\.resume=true"):
        main(config(run_dir, "run.steps=2"))


def test_resume_without_checkpoint_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no finished checkpoint"):
        main(config(tmp_path / "run", "run.resume=true"))


def test_unknown_preset_names_the_group() -> None:
    with pytest.raises(HydraException) as info:
        config(Path("unused"), "hardware=nonexistent")
    message = one_paragraph(info.value)
    assert "hardware/nonexistent" in message
    assert "local" in message  # the available presets
    assert "\n" not in message


@pytest.mark.parametrize("option", ["data.paths=[/nonexistent.tsv]", "data.path=/nonexistent.tsv"])
def test_missing_data_file_names_the_path(tmp_path: Path, option: str) -> None:
    cfg = config(tmp_path / "run", "data=criteo_tsv", option)
    with pytest.raises(ConfigError) as info:
        main(cfg)
    message = str(info.value)
    assert "/nonexistent.tsv" in message
    assert "\n" not in message
    assert not list((tmp_path / "run").glob("tiers/*/*/*.rows"))  # failed before building


def test_unparsable_dram_budget_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"planner\.dram_budget='lots'"):
        main(config(tmp_path / "run", "planner.dram_budget=lots"))


def test_unwritable_run_dir_names_run_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"run\.dir="):
        main(config(blocker / "run"))


def test_wrong_number_of_tables_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_embeddings_per_feature"):
        main(config(tmp_path / "run", "model.num_embeddings_per_feature=[10,20]"))


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under capture
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["hardware=nonexistent"], "hardware/nonexistent"),
        (["planner.dram_budget=lots"], "planner.dram_budget"),
    ],
)
def test_cli_prints_one_paragraph(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    overrides: list[str],
    expected: str,
) -> None:
    # run() sets HYDRA_FULL_ERROR itself; setenv makes monkeypatch restore the original.
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setenv("MTRAINS_TRACEBACK", "0")
    monkeypatch.setattr(sys, "argv", ["train", f"run.dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(SystemExit) as info:
        run()
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_subprocess_has_no_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(
        [sys.executable, "-m", "apps.dlrm.train", "hardware=nonexistent"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ")
    assert "hardware/nonexistent" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cache_smaller_than_a_batch_names_the_knobs(tmp_path: Path) -> None:
    # 2,000 rows x 0.01 = 20 cache rows, fewer than one 64-sample batch's distinct ids.
    with pytest.raises(ConfigError, match=r"planner\.cache_load_factor.*data\.batch_size"):
        main(config(tmp_path / "run", "planner.cache_load_factor=0.01", "run.steps=2"))


def test_ranks_are_balanced_largest_table_first() -> None:
    rows = [1_000_000, 1_000_000, 1_000_000, 500_000, 500_000, 286_181, 1460, 3]
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(rows)
    ]
    ranks = balance_ranks(configs, world_size=2)
    load = [0, 0]
    for config in configs:
        load[ranks[config.name]] += table_bytes(config)
    assert abs(load[0] - load[1]) <= max(table_bytes(c) for c in configs) // 2
    # the three largest tables do not all land on one rank
    assert {ranks["t0"], ranks["t1"], ranks["t2"]} == {0, 1}


def test_lookahead_trains_exactly_as_the_plain_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look-ahead pipeline changes when rows are read, never what is trained: the same
    losses, evaluation and tier traffic, with the stall moved off the training thread."""
    steps: list[int] = []
    progress = LookaheadTrainPipeline.progress

    def counted(self: LookaheadTrainPipeline[Any, Any], it: Any) -> Any:
        steps.append(self.lookahead)
        return progress(self, it)

    monkeypatch.setattr(LookaheadTrainPipeline, "progress", counted)
    plain = main(config(tmp_path / "plain", "run.steps=12", "pipeline.lookahead=0"))
    assert steps == []
    ahead = main(config(tmp_path / "ahead", "run.steps=12", "pipeline.lookahead=2"))
    assert steps == [2] * 12

    for key in ("steps", "train_loss_last", "train_loss_mean_last_10pct", "eval_auc", "eval_ne"):
        assert ahead[key] == plain[key], key
    assert ahead["rows_fetched"] == plain["rows_fetched"] > 0
    assert (ahead["lookahead"], plain["lookahead"]) == (2, 0)
    written = read_metrics(tmp_path / "ahead")
    for key in ("stall_s", "prefetch_io_s", "rows_fetched", "stall_share"):
        assert written[key] == ahead[key], key
    # Without look-ahead every tier read is on the training thread's path.
    assert plain["stall_s"] >= plain["prefetch_io_s"] > 0
    assert 0 <= ahead["stall_share"] < 1


def test_read_ahead_builds_batches_off_the_training_thread_and_trains_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pipeline.read_ahead moves building the batches to a background thread and changes
    nothing that is trained or evaluated."""
    builders: list[tuple[str, int]] = []
    batch_at = SyntheticCriteoDataset.batch_at

    def recorded(self: SyntheticCriteoDataset, index: int) -> Any:
        builders.append((threading.current_thread().name, index))
        return batch_at(self, index)

    main_thread = threading.current_thread().name
    monkeypatch.setattr(SyntheticCriteoDataset, "batch_at", recorded)
    inline = main(config(tmp_path / "inline", "run.steps=10", "pipeline.read_ahead=0"))
    assert {name for name, _ in builders} == {main_thread}
    builders.clear()
    ahead = main(config(tmp_path / "ahead", "run.steps=10", "pipeline.read_ahead=3"))
    # The main thread only peeks at the first training and held-out batches (their ids are
    # checked before any tier is built); every batch trained or evaluated comes from the
    # read-ahead thread.
    assert [(n, i) for n, i in builders if n != "dlrm-data"] == [(main_thread, 0)] * 2
    assert sum(n == "dlrm-data" for n, _ in builders) >= 10 + 4
    assert not [t for t in threading.enumerate() if t.name == "dlrm-data"]  # all stopped

    for key in ("steps", "train_loss_last", "train_loss_mean_last_10pct", "eval_auc", "eval_ne"):
        assert ahead[key] == inline[key], key
    assert ahead["rows_fetched"] == inline["rows_fetched"] > 0


def test_negative_read_ahead_names_the_option_before_any_tier_is_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.read_ahead=-2"):
        main(config(tmp_path / "run", "pipeline.read_ahead=-2"))
    assert not (tmp_path / "run" / "tiers").exists()


def test_negative_lookahead_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.lookahead=-1"):
        main(config(tmp_path / "run", "pipeline.lookahead=-1"))


def _tiered(run_dir: Path, *overrides: str) -> DictConfig:
    base = [o for o in TINY if not o.startswith("planner")]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[
                *base,
                "planner=tiered_capacity_bound",
                "planner.dram_budget=600KB",  # also the log index (4 B a row) and I/O buffers
                "planner.byte_scm_budget=300KB",
                "planner.min_cache_rows=64",
                "run.steps=12",
                f"run.dir={run_dir}",
                *overrides,
            ],
        )


def test_tiered_planner_places_large_tables_on_both_scm_tiers(tmp_path: Path) -> None:
    metrics = main(_tiered(tmp_path / "run"))
    plan = (tmp_path / "run" / "plan.txt").read_text()
    assert "assumed uniform" in plan
    assert "byte_scm" in plan and "block_scm" in plan
    assert metrics["steps"] == 12
    assert 0.0 <= float(metrics["cache_hit_rate"]) <= 1.0  # type: ignore[arg-type]


def test_tiered_planner_uses_a_profile_and_pins_its_hot_rows(tmp_path: Path) -> None:
    from apps.dlrm.profile import main as profile_main

    prefix = tmp_path / "profile"
    overrides = [o for o in TINY if not o.startswith(("planner", "run."))]
    args = ["--out", str(prefix), "--conf-dir", str(CONF), "--max-batches", "30"]
    assert profile_main([*args, *overrides]) == 0
    GlobalHydra.instance().clear()
    profile = prefix.with_suffix(".json")
    cfg = _tiered(tmp_path / "run", f"planner.profile={profile}")
    metrics = main(cfg)
    plan = (tmp_path / "run" / "plan.txt").read_text()
    assert "measured" in plan
    pinned = [t for t in metrics["tables"].values() if t.get("pinned_rows", 0) > 0]  # type: ignore[union-attr]
    assert pinned, metrics["tables"]


def test_dram_budget_too_small_for_any_plan_is_one_paragraph(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"planner\.dram_budget \(now 200KB\)") as info:
        main(_tiered(tmp_path / "run", "planner.dram_budget=200KB"))
    message = str(info.value)
    assert "\n" not in message and "OVER by" in message


def test_dram_budget_too_small_for_the_io_buffers_names_both_knobs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"planner\.dram_budget \(now 1KB\)") as info:
        main(_tiered(tmp_path / "run", "planner.dram_budget=1KB"))
    message = str(info.value)
    assert "\n" not in message and "hardware.block_scm.max_pass_bytes=65536" in message


def test_run_device_cuda_without_a_gpu_is_one_paragraph(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match=r"run\.device=cuda but no GPU is visible") as info:
        main(config(tmp_path / "run", "run.device=cuda"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_gpu_preset_plans_for_the_device_the_run_uses(tmp_path: Path) -> None:
    """``hardware=gpu_pmem_nvme`` describes 8 GPUs; with ``run.device=cpu`` the plan, the model
    and the caches must all be on the CPU (they were planned for CUDA and built on the CPU)."""
    run_dir = tmp_path / "run"
    metrics = main(
        _tiered(
            run_dir,
            "hardware=gpu_pmem_nvme",
            f"hardware.tier_root={run_dir}/tiers",
            "run.device=cpu",
        )
    )
    assert metrics["steps"] == 12
    plan = (run_dir / "plan.txt").read_text()
    assert "hbm" not in plan  # no HBM column: no table or cache planned there


def _tiny_ebc() -> EmbeddingBagCollection:
    """The tiny model's tables (dim 16), on the meta device: for plans made without a model."""
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t_cat_{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"cat_{i}"]
            )
            for i, n in enumerate(SIZES)
        ],
        device=torch.device("meta"),
    )


def _size_rule_placement(
    large_tables: LargeTables, device_type: str, cache_policy: str = "lru"
) -> tuple[Any, list[Any]]:
    """The tiny model's size-rule plan (200 KB DRAM budget, load factor 0.25) for
    ``device_type``, made without a device."""
    ebc = _tiny_ebc()
    sharder = TieredEmbeddingBagCollectionSharder(TierStorage(), offer_tiered_kernel=False)
    return size_rule_plan(
        ebc,
        sharder,
        world_size=1,
        dram_budget=200_000,
        block_scm_min_bytes=200_000,
        cache_load_factor=0.25,
        cache_policy=cache_policy,
        device_type=device_type,
        large_tables=large_tables,
    )


def test_large_tables_may_go_to_torchrecs_uvm_caching_instead_of_the_tiers() -> None:
    """``planner.large_tables=uvm_caching``: the tables past the DRAM budget go to TorchRec's
    FUSED_UVM_CACHING kernel with the cache load factor (the baseline the tiers are compared
    with on a GPU); the others stay FUSED, as with the tiers."""
    plan, placements = _size_rule_placement(LargeTables.UVM_CACHING, "cuda")
    tiered_plan_, _ = _size_rule_placement(LargeTables.TIERED, "cuda")
    big = {n for n, ps in tiered_plan_.items() if isinstance(ps, TieredParameterSharding)}
    assert len(big) == TIERED_TABLES
    for name, ps in plan.items():
        assert not isinstance(ps, TieredParameterSharding)
        if name in big:
            assert ps.compute_kernel == "fused_uvm_caching", name
            assert ps.cache_params is not None and ps.cache_params.load_factor == 0.25
            assert ps.cache_params.algorithm is CacheAlgorithm.LRU  # planner.cache_policy
        else:
            assert ps.compute_kernel == "fused" and ps.cache_params is None, name
    rows = {p.table: p.rows for p in placements}
    assert {p.table: p.cache_rows for p in placements if p.kernel == "uvm_caching"} == {
        name: rows[name] // 4 for name in big
    }
    assert "uvm_caching" in format_placements(placements)


@register_policy
class _OwnPolicy(LRUPolicy):
    """A registered policy of the project's own that fbgemm's cache has no counterpart of."""

    name = "test-train-own"
    fbgemm_algorithm = None


def test_uvm_caching_runs_the_cache_policy_or_refuses_it_naming_the_tables() -> None:
    """fbgemm's cache (FUSED_UVM_CACHING) runs LRU and LFU: ``lfu`` reaches it as LFU, and a
    policy of the project's own is refused naming the tables, never run as fbgemm's LRU."""
    plan, _ = _size_rule_placement(LargeTables.UVM_CACHING, "cuda", cache_policy="lfu")
    on_uvm = [ps for ps in plan.values() if ps.compute_kernel == "fused_uvm_caching"]
    assert len(on_uvm) == TIERED_TABLES
    assert all(ps.cache_params.algorithm is CacheAlgorithm.LFU for ps in on_uvm)
    with pytest.raises(ConfigError) as info:
        _size_rule_placement(LargeTables.UVM_CACHING, "cuda", cache_policy=_OwnPolicy.name)
    message = str(info.value)
    assert message.startswith("tables t_cat_") and " on FUSED_UVM_CACHING cannot run " in message
    assert (
        f"planner.cache_policy='{_OwnPolicy.name}': cache policy '{_OwnPolicy.name}' has no "
        "counterpart in fbgemm's cache"
    ) in message
    tiered, _ = _size_rule_placement(LargeTables.TIERED, "cuda", cache_policy=_OwnPolicy.name)
    assert {
        ps.tier_options.cache_policy
        for ps in tiered.values()
        if isinstance(ps, TieredParameterSharding)
    } == {_OwnPolicy.name}  # the tiered caches run it


def test_uvm_caching_off_cuda_and_unknown_large_tables_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"large_tables=uvm_caching.*CUDA only.*cpu") as info:
        main(config(tmp_path / "a", "planner.large_tables=uvm_caching"))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"large_tables='hbm': give one of tiered, uvm_caching"):
        main(config(tmp_path / "b", "planner.large_tables=hbm"))
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.cuda
def test_app_trains_with_the_large_tables_on_torchrecs_uvm_caching(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    metrics = main(
        config(run_dir, "run.device=cuda", "run.steps=12", "planner.large_tables=uvm_caching")
    )
    assert metrics["steps"] == 12 and math.isfinite(float(metrics["train_loss_last"]))  # type: ignore[arg-type]
    plan = (run_dir / "plan.txt").read_text()
    assert plan.count("uvm_caching") == TIERED_TABLES, plan


@pytest.mark.cuda
@pytest.mark.parametrize("planner", ["size_rule", "tiered"])
def test_app_trains_on_cuda_and_resumes_on_the_cpu(tmp_path: Path, planner: str) -> None:
    """The app on a GPU: plan for CUDA (FUSED tables and caches in HBM, rows on the tiers),
    look-ahead 2, a checkpoint; then the same run resumed on the CPU from that checkpoint."""
    run_dir = tmp_path / "run"
    extra = ["run.steps=20", "pipeline.lookahead=2"]
    cfg = (
        config(run_dir, "run.device=cuda", *extra)
        if planner == "size_rule"
        else _tiered(run_dir, "run.device=cuda", *extra)
    )
    metrics = main(cfg)
    assert metrics["steps"] == 20 and math.isfinite(float(metrics["train_loss_last"]))  # type: ignore[arg-type]
    assert "hbm" in (run_dir / "plan.txt").read_text()
    GlobalHydra.instance().clear()
    resumed = main(
        (config if planner == "size_rule" else _tiered)(
            run_dir, "run.device=cpu", "run.resume=true", "run.steps=24", "pipeline.lookahead=2"
        )
    )
    assert resumed["resumed_from_step"] == 20 and resumed["steps"] == 24


def test_tiered_plan_reads_the_apps_config(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                f"model.num_embeddings_per_feature=[{','.join(map(str, SIZES))}]",
                "planner=tiered",
                "planner.dram_budget=1.2MB",
                "hardware.block_scm.max_pass_bytes=65536",  # a small budget's I/O passes
                "pipeline.lookahead=2",
                "data.batch_size=256",
            ],
        )
    ebc = _tiny_ebc()
    sharder = TieredEmbeddingBagCollectionSharder(offer_tiered_kernel=True)
    plan, text = tiered_plan(to_app_config(cfg), ebc, sharder, 1, torch.device("cpu"))
    assert set(plan) == {f"t_cat_{i}" for i in range(len(SIZES))}
    assert "local" in text and "assumed uniform" in text
    # The budget is honoured: 1.36 MB of tables do not all fit in 1.2 MB of DRAM.
    assert any(isinstance(ps, TieredParameterSharding) for ps in plan.values())


def test_final_checkpoint_can_be_skipped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    metrics = main(config(run_dir, "run.steps=6", "run.final_checkpoint=false"))
    assert metrics["steps"] == 6 and metrics["checkpoint"] is None
    assert not list(run_dir.glob("checkpoints/*/DONE"))
    # A periodic checkpoint of the same run is still the one to resume from.
    run_dir = tmp_path / "periodic"
    metrics = main(
        config(run_dir, "run.steps=6", "run.checkpoint_every=4", "run.final_checkpoint=false")
    )
    assert metrics["checkpoint"] == str(run_dir / "checkpoints" / "step_00000004")


def test_the_block_tiers_log_layout_trains_resumes_and_matches_the_flat_one(
    tmp_path: Path,
) -> None:
    """``hardware.block_scm.layout=log`` keeps the block tier's tables in log-structured files:
    a run stopped after a checkpoint resumes from them, reopening them, and ends exactly where
    the same run on the flat layout ends."""
    log = ["hardware.block_scm.layout=log"]
    flat = main(config(tmp_path / "flat", "run.steps=16"))
    main(config(tmp_path / "log", *log, "run.steps=12", "run.checkpoint_every=8"))
    (tmp_path / "log" / "checkpoints" / "step_00000012" / "DONE").unlink()
    record = json.loads((tmp_path / "log" / "plan.json").read_text())
    files = [Path(f).name for f in record["files"]["0"]]
    assert any(f.endswith(".log_block_scm.rows") for f in files), files
    assert not any(f.endswith(".block_scm.rows") and "log_" not in f for f in files), files
    resumed = main(config(tmp_path / "log", *log, "run.steps=16", "run.resume=true"))

    assert resumed["resumed_from_step"] == 8
    assert resumed["tier_files"]["created"] == 0
    assert resumed["train_loss_last"] == pytest.approx(flat["train_loss_last"], abs=1e-5)
    assert resumed["eval_auc"] == pytest.approx(flat["eval_auc"], abs=1e-5)
