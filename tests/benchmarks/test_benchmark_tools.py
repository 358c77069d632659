"""The benchmarks' shared tools (``torchrec_mtrains.benchmark``): the memory-cap runner and
what it reports, timed windows, tier file digests."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from torchrec_mtrains.benchmark import measure, memory_cap
from torchrec_mtrains.benchmark.tier_files import row_digest
from torchrec_mtrains.tiers import OpenMode, open_store
from torchrec_mtrains.types import RowLayout


def test_cgroup_support_explains_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_cap.os, "geteuid", lambda: 1000)
    support = memory_cap.cgroup_support()
    assert not support.ok and "root" in support.reason
    with pytest.raises(RuntimeError, match="root"):
        memory_cap.MemoryCgroup(support, "x", 1 << 30)


def test_median_windows() -> None:
    r = measure.median_windows([1.0, 2.0, 4.0], 100)
    assert r["window_samples_per_s"] == [100.0, 50.0, 25.0] and r["samples_per_s"] == 50.0


def test_run_capped_reports_the_exit_code_the_log_and_the_peaks(tmp_path: Path) -> None:
    """The runner waits for the command, keeps its output in the log and reports its peak
    memory: 64 MiB the child touched show in both its peak RSS and its anonymous peak."""
    support = memory_cap.cgroup_support()
    log = tmp_path / "run.log"
    code = (
        "import sys, time; b = bytearray(64 << 20); time.sleep(0.5); "
        "print('done', len(b)); sys.exit(3)"
    )
    cap = 1 << 30 if support.ok else None
    r = memory_cap.run_capped([sys.executable, "-c", code], support, "t", cap, log=log)
    assert r["returncode"] == 3 and r["wall_s"] >= 0.5
    assert log.read_text().strip() == f"done {64 << 20}"
    assert r["peak_rss_bytes"] >= 64 << 20
    assert r["peak_anon_bytes"] >= 64 << 20
    if support.ok:
        assert r["cgroup_peak_bytes"] >= 64 << 20 and r["oom_kills"] == 0
    else:
        assert "cgroup_peak_bytes" not in r


@pytest.mark.parametrize("tier", ["block_scm", "log_block_scm", "byte_scm"])
def test_a_row_digest_sees_every_row_and_not_the_files_order(tmp_path: Path, tier: str) -> None:
    """Two files with the same rows written in different orders digest alike; one changed
    float anywhere changes the digest."""
    layout = RowLayout(num_rows=300, dim=4, state_width=1)
    rows = np.random.default_rng(0).standard_normal((300, layout.row_width)).astype(np.float32)
    paths = []
    for name, order in (("a", np.arange(300)), ("b", np.arange(300)[::-1].copy())):
        (tmp_path / name).mkdir()
        with open_store(tier, tmp_path / name, "t", layout, mode=OpenMode.TRUNCATE) as store:
            for chunk in np.array_split(order, 7):
                store.write_rows(chunk, rows[chunk])
            store.flush()
            paths.append(store.path)
    assert row_digest(paths[0]) == row_digest(paths[1])
    with open_store(tier, tmp_path / "b", "t", layout, mode=OpenMode.OPEN) as store:
        changed = rows[[123]].copy()
        changed[0, 2] += 1.0
        store.write_rows(np.array([123]), changed)
        store.flush()
    assert row_digest(paths[0]) != row_digest(paths[1])


def test_the_disk_probe_reads_a_written_file_at_random_and_removes_it(tmp_path: Path) -> None:
    from torchrec_mtrains.benchmark.disk import random_read_iops

    r = random_read_iops(tmp_path, 4 << 20, 0.2, queue_depth=8)
    assert r["source"] in ("fio", "uring", "aio", "threads") and float(r["iops"]) > 0
    assert not list(tmp_path.iterdir())


def test_a_target_is_met_below_a_ceiling_or_above_a_floor_and_unknown_unmeasured() -> None:
    assert measure.target(0.96, 0.95)["met"] is True
    assert measure.target(30.0, 25.0, at_most=True)["met"] is False
    assert measure.target(None, 25.0)["met"] is None


def test_w1s_model_takes_the_pooled_embeddings_by_feature_in_any_output_order() -> None:
    # A sharded collection orders its output by its kernel groups: in W1's U the FUSED tables
    # come first, then the FUSED_UVM_CACHING ones. W1's model must see the same features in
    # the same columns whatever the plan.
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

    from apps.dlrm.workloads.w1 import W1Model

    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=4, num_embeddings=10, feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]
    values = {
        f"f{i}": torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)
    }

    class Pooled(torch.nn.Module):
        def __init__(self, order: list[str]) -> None:
            super().__init__()
            self.order = order

        def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
            return configs

        def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
            return KeyedTensor.from_tensor_list(self.order, [values[k] for k in self.order])

    batch = Batch(
        dense_features=torch.randn(5, 3, generator=torch.Generator().manual_seed(9)),
        sparse_features=KeyedJaggedTensor.empty(),
        labels=torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]),
    )
    losses = []
    for order in (["f0", "f1", "f2"], ["f1", "f2", "f0"]):
        torch.manual_seed(0)
        losses.append(W1Model(Pooled(order), num_dense=3)(batch)[0])  # type: ignore[arg-type]
    assert torch.equal(losses[0], losses[1])
