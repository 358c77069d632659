"""``run.bounds_check``: a batch holding an id outside its table stops the run by default, naming
the table, the feature and the id, also for a table on TorchRec's FUSED kernel in DRAM (where
TorchRec alone would warn and train on); ``run.bounds_check=warn`` trains on with a warning."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from dlrm_helpers import SIZES, app_config

from apps.dlrm.config import to_app_config
from apps.dlrm.errors import ConfigError
from apps.dlrm.train import main
from torchrec_mtrains.distributed.options import BoundsCheck
from torchrec_mtrains.distributed.tiered_tables import TableIdError

BATCH = 16
ROWS = 6 * BATCH  # 5 training batches, 1 held out (eval_fraction 1/6)
FEATURE = 2  # t_cat_2: 100 rows, on the FUSED kernel in DRAM under the tiny plan
BAD_ID = 150


def _write_data(root: Path) -> Path:
    """Criteo .npy files whose ids fit the tables except one id of ``cat_2`` in the second
    training batch (so the app's check of the first batch lets it through)."""
    rng = np.random.default_rng(0)
    sparse = np.stack([rng.integers(0, n, ROWS) for n in SIZES], axis=1)
    sparse[BATCH + 3, FEATURE] = BAD_ID
    np.save(root / "day_0_sparse.npy", sparse.astype(np.int64))
    np.save(root / "day_0_dense.npy", rng.random((ROWS, 13), dtype=np.float32))
    np.save(root / "day_0_labels.npy", rng.integers(0, 2, (ROWS, 1)))
    return root


def _config(tmp_path: Path, *overrides: str) -> object:
    data = _write_data(tmp_path)
    # The data's sizes let the bad id through unhashed (the model's would fold it in range).
    data_sizes = list(SIZES)
    data_sizes[FEATURE] = 1000
    return app_config(
        tmp_path / "run",
        "data=criteo_npy",
        f"data.data_dir={data}",
        f"data.batch_size={BATCH}",
        f"data.num_embeddings_per_feature=[{','.join(map(str, data_sizes))}]",
        f"data.eval_fraction={1 / 6}",
        "run.steps=4",
        "run.eval_batches=1",
        "run.device=cpu",
        *overrides,
    )


def test_out_of_range_id_in_a_fused_dram_table_stops_the_run(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert to_app_config(cfg).run.bounds_check_rule is BoundsCheck.ERROR  # the default
    with pytest.raises((TableIdError, ConfigError)) as err:
        main(cfg)
    message = str(err.value)
    assert f"table 't_cat_{FEATURE}': row id {BAD_ID} (feature 'cat_{FEATURE}')" in message
    assert "[0, 100)" in message
    plan = (tmp_path / "run" / "plan.txt").read_text()
    assert any(
        f"t_cat_{FEATURE} " in line and "fused" in line.lower() for line in plan.splitlines()
    ), plan


def test_warn_trains_on_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _config(tmp_path, "run.bounds_check=warn")
    with caplog.at_level(logging.WARNING, logger="torchrec_mtrains.distributed.sharded"):
        metrics = main(cfg)
    assert metrics["steps"] == 4
    warned = [r.getMessage() for r in caplog.records if "out of range" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"table 't_cat_{FEATURE}': row id {BAD_ID} (feature 'cat_{FEATURE}')" in warned[0]


def test_a_bad_value_is_a_config_error_naming_the_option(tmp_path: Path) -> None:
    cfg = app_config(tmp_path / "run", "run.bounds_check=fatal")
    with pytest.raises(ConfigError, match=r"run\.bounds_check='fatal'.*error, warn"):
        main(cfg)
