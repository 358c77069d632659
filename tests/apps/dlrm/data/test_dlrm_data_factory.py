"""build_dataloader: dispatch on kind, plain mappings and Hydra-composed configs, bad kinds."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from apps.dlrm.data import (
    CONFIG_KINDS,
    CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE,
    CriteoNpyDataConfig,
    CriteoTsvDataConfig,
    CriteoTsvDataset,
    SyntheticCriteoDataset,
    SyntheticDataConfig,
    build_dataloader,
    register_configs,
)


def test_kaggle_cardinalities() -> None:
    sizes = CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE
    assert len(sizes) == 26
    assert (sizes[0], sizes[2], sizes[20], sizes[25]) == (1460, 10131227, 7046547, 142572)
    assert sum(sizes) == 33762577


def test_dispatches_on_the_config_type(tmp_path: Path) -> None:
    synthetic = build_dataloader(SyntheticDataConfig(batch_size=4, num_batches=3), 1, 2)
    assert isinstance(synthetic, SyntheticCriteoDataset)
    assert (synthetic.rank, synthetic.world_size) == (1, 2)
    assert len(list(synthetic)) == 3
    tsv = tmp_path / "day_0"
    tsv.write_text("\t".join(["1"] + ["1"] * 13 + ["a"] * 26) + "\n")
    assert isinstance(
        build_dataloader(CriteoTsvDataConfig(paths=[str(tsv)]), 0, 1), CriteoTsvDataset
    )
    with pytest.raises(FileNotFoundError, match=r"day_0_dense\.npy"):
        build_dataloader(CriteoNpyDataConfig(data_dir=str(tmp_path)), 0, 1)


def test_accepts_plain_mappings_and_start_batch() -> None:
    cfg = {
        "kind": "synthetic",
        "batch_size": 4,
        "num_batches": 5,
        "num_embeddings_per_feature": [9],
    }
    ds = build_dataloader(cfg, 0, 1, start_batch=3)
    assert isinstance(ds, SyntheticCriteoDataset)
    assert len(list(ds)) == 2


def test_bad_kind_lists_the_allowed_kinds() -> None:
    with pytest.raises(ValueError, match="'synthetic', 'criteo_tsv', 'criteo_npy'"):
        build_dataloader({"kind": "parquet"}, 0, 1)
    with pytest.raises(ValueError, match="not one of"):
        build_dataloader({"batch_size": 4}, 0, 1)
    with pytest.raises(ValueError, match="needs a SyntheticDataConfig"):
        build_dataloader(CriteoTsvDataConfig(kind="synthetic"), 0, 1)
    with pytest.raises(ValueError, match=r"unknown fields .*'batchsize'"):
        build_dataloader({"kind": "synthetic", "batchsize": 4}, 0, 1)


def test_hydra_structured_configs_compose_with_overrides(tmp_path: Path) -> None:
    group = "test_dlrm_data_layer"  # a private group: the ConfigStore is process-wide
    register_configs(group)
    (tmp_path / "config.yaml").write_text(f"defaults:\n  - {group}: synthetic\n  - _self_\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(
            "config",
            overrides=[
                f"{group}.batch_size=16",
                f"{group}.num_sparse_features=2",
                f"{group}.num_embeddings_per_feature=[10,20]",
                f"{group}.zipf_exponents=[0.0]",
            ],
        )
        with pytest.raises(ConfigCompositionException, match="batch_size"):
            compose("config", overrides=[f"{group}.batch_size=many"])  # typed fields
        tsv = compose("config", overrides=[f"{group}=criteo_tsv"])
    node = cfg[group]
    ds = build_dataloader(node, 0, 1)
    assert isinstance(ds, SyntheticCriteoDataset)
    assert ds.num_embeddings_per_feature == [10, 20]
    assert ds.batch_at(0).dense_features.shape == (16, 13)
    assert OmegaConf.to_object(tsv[group]) == CriteoTsvDataConfig()
    assert set(CONFIG_KINDS) == {"synthetic", "criteo_tsv", "criteo_npy"}
