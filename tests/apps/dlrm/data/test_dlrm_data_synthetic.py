"""Synthetic source: shape, determinism, sharding, skew, scattering, memory and learnability."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch

from apps.dlrm.data import (
    CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE,
    FeistelPermutation,
    SyntheticCriteoDataset,
    SyntheticDataConfig,
    ZipfRankSampler,
)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny ops gain nothing from intra-op threads, and on a shared 2-core machine their
    spin-waiting makes them 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small(**overrides: object) -> SyntheticDataConfig:
    fields: dict[str, object] = {
        "batch_size": 64,
        "num_batches": 8,
        "num_embeddings_per_feature": [1000],
        "seed": 3,
    }
    fields.update(overrides)
    return SyntheticDataConfig(**fields)  # type: ignore[arg-type]


def _assert_batches_equal(a: Batch, b: Batch) -> None:
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.labels, b.labels)
    assert a.sparse_features.keys() == b.sparse_features.keys()
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


def _ids_of(batch: Batch, key: str) -> np.ndarray:
    return batch.sparse_features[key].values().numpy()


def test_default_batch_is_criteo_shaped() -> None:
    ds = SyntheticCriteoDataset(SyntheticDataConfig(batch_size=32, num_batches=2))
    batches = list(ds)
    assert len(batches) == len(ds) == 2
    batch = batches[0]
    assert batch.dense_features.shape == (32, 13)
    assert batch.dense_features.dtype == torch.float32
    assert bool((batch.dense_features >= 0).all())  # log1p of non-negative counts
    assert batch.sparse_features.keys() == DEFAULT_CAT_NAMES
    assert batch.sparse_features.values().dtype == torch.int64
    assert bool((batch.sparse_features.lengths() == 1).all())
    assert batch.labels.shape == (32,)
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}


def test_feature_counts_are_configurable() -> None:
    cfg = _small(num_dense_features=4, num_sparse_features=3, num_embeddings_per_feature=[5, 6, 7])
    batch = SyntheticCriteoDataset(cfg).batch_at(0)
    assert batch.dense_features.shape == (64, 4)
    assert batch.sparse_features.keys() == ["cat_0", "cat_1", "cat_2"]
    assert batch.sparse_features.values().numel() == 3 * 64


def test_batches_are_pure_functions_of_seed_and_index() -> None:
    a, b = SyntheticCriteoDataset(_small()), SyntheticCriteoDataset(_small())
    _assert_batches_equal(a.batch_at(5), b.batch_at(5))
    for index, batch in enumerate(a):
        _assert_batches_equal(batch, b.batch_at(index))
    resumed = list(SyntheticCriteoDataset(_small(), start_batch=6))
    assert len(resumed) == 2
    _assert_batches_equal(resumed[0], a.batch_at(6))
    other_seed = SyntheticCriteoDataset(_small(seed=4)).batch_at(5)
    assert not torch.equal(
        other_seed.sparse_features.values(), a.batch_at(5).sparse_features.values()
    )
    assert not torch.equal(a.batch_at(1).dense_features, a.batch_at(2).dense_features)


def test_ranks_draw_disjoint_parts_of_the_single_process_stream() -> None:
    single = SyntheticCriteoDataset(_small())
    ranks = [SyntheticCriteoDataset(_small(), rank=r, world_size=2) for r in range(2)]
    for i in range(3):
        for r in range(2):
            _assert_batches_equal(ranks[r].batch_at(i), single.batch_at(2 * i + r))
    assert not torch.equal(ranks[0].batch_at(0).dense_features, ranks[1].batch_at(0).dense_features)


def test_dataloader_workers_keep_the_single_process_order() -> None:
    ds = SyntheticCriteoDataset(_small(num_batches=5))
    loaded = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(loaded) == 5
    for index, batch in enumerate(loaded):
        _assert_batches_equal(batch, ds.batch_at(index))


def test_ids_lie_in_each_table_and_pooling_follows_config() -> None:
    sizes = list(CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE)
    pooling = [1 + (t % 4) * 3 for t in range(26)]  # 1, 4, 7, 10, ...
    cfg = _small(
        batch_size=512,
        num_embeddings_per_feature=sizes,
        pooling_factors=pooling,
        random_pooling=True,
    )
    batch = SyntheticCriteoDataset(cfg).batch_at(0)
    for t, key in enumerate(DEFAULT_CAT_NAMES):
        jagged = batch.sparse_features[key]
        ids, lengths = jagged.values().numpy(), jagged.lengths().numpy()
        assert ids.min() >= 0 and ids.max() < sizes[t]
        assert lengths.min() >= 1 and lengths.max() <= 2 * pooling[t] - 1
        assert abs(lengths.mean() - pooling[t]) < 0.1 * pooling[t] + 0.05
    fixed = SyntheticCriteoDataset(_small(pooling_factors=[3])).batch_at(0)
    assert bool((fixed.sparse_features.lengths() == 3).all())


def _top_share(ids: np.ndarray, n: int, fraction: float) -> float:
    counts = np.sort(np.bincount(ids, minlength=n))[::-1]
    return float(counts[: int(n * fraction)].sum() / counts.sum())


def test_skew_concentrates_accesses_and_zero_skew_is_uniform() -> None:
    n = 10_000

    def ids(exponent: float) -> np.ndarray:
        cfg = _small(
            batch_size=100_000,
            num_dense_features=0,
            num_sparse_features=1,
            num_embeddings_per_feature=[n],
            zipf_exponents=[exponent],
        )
        ds = SyntheticCriteoDataset(cfg)
        return np.concatenate([_ids_of(ds.batch_at(i), "cat_0") for i in range(10)])

    # Exact share of the top 1% of rows under Zipf(1.1) on 10k rows is 0.648.
    assert _top_share(ids(1.1), n, 0.01) == pytest.approx(0.648, abs=0.01)
    uniform = ids(0.0)
    assert _top_share(uniform, n, 0.01) < 0.0135  # 1% plus sampling noise
    assert np.bincount(uniform, minlength=n).min() > 0


@pytest.mark.parametrize("exponent", [0.8, 1.0, 1.1, 1.5])
def test_zipf_sampler_matches_the_exact_bounded_law(exponent: float) -> None:
    n = 1_000_000
    exact_cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)
    exact_cdf /= exact_cdf[-1]
    ranks = ZipfRankSampler(n, exponent).sample(np.random.default_rng(0), 1_000_000)
    assert ranks.min() >= 0 and ranks.max() < n
    # Points inside the exact head (<= 1024) and in the continuous tail.
    for k in [1, 2, 10, 1000, 1024, 1025, 5000, 100_000, 900_000]:
        assert (ranks < k).mean() == pytest.approx(exact_cdf[k - 1], abs=0.003), k


def test_hot_rows_are_scattered_over_the_table() -> None:
    n = 1_000_000
    cfg = _small(
        batch_size=50_000,
        num_dense_features=0,
        num_sparse_features=2,
        num_embeddings_per_feature=[n],
    )
    ds = SyntheticCriteoDataset(cfg)
    hottest = ds.hottest_rows(0, 1000)
    assert len(set(hottest.tolist())) == 1000
    assert 0.4 * n < hottest.mean() < 0.6 * n  # spread, not the low ids
    assert not np.array_equal(hottest, ds.hottest_rows(1, 1000))  # each table its own order
    counts = np.bincount(_ids_of(ds.batch_at(0), "cat_0"), minlength=n)
    assert set(np.argsort(counts)[::-1][:3].tolist()) == set(hottest[:3].tolist())


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), key=st.integers(0, 2**63))
def test_feistel_permutation_is_a_bijection(n: int, key: int) -> None:
    perm = FeistelPermutation(n, key)
    image = perm(np.arange(n))
    assert np.array_equal(np.sort(image), np.arange(n))
    if n >= 100:
        assert (image != np.arange(n)).mean() > 0.9


def test_feistel_permutation_rejects_ids_outside_the_table() -> None:
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        FeistelPermutation(10, 1)(np.array([10]))


_PEAK_OF_HUGE_TABLES = """
import tracemalloc
from apps.dlrm.data import SyntheticCriteoDataset, SyntheticDataConfig
config = SyntheticDataConfig(
    batch_size=1024, num_batches=8, num_embeddings_per_feature=[10_000_000] * 26, seed=3
)
tracemalloc.start()
batch = SyntheticCriteoDataset(config).batch_at(0)
print(tracemalloc.get_traced_memory()[1], int(batch.sparse_features.values().max()))
"""


def test_huge_tables_need_little_memory() -> None:
    """Measured with ``tracemalloc`` in a fresh process: in this one, threads other tests
    left may allocate while it stops, which crashes CPython before 3.12
    (python/cpython#128679)."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_HUGE_TABLES],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parents[4],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    peak, largest_id = map(int, done.stdout.split())
    # One stored permutation or weight vector of one table would be 80 MB.
    assert peak < 4 * 2**20
    assert largest_id < 10_000_000


def test_invalid_configs_are_rejected() -> None:
    with pytest.raises(ValueError, match="zipf_exponents has 2 entries"):
        SyntheticCriteoDataset(_small(num_sparse_features=3, zipf_exponents=[1.0, 1.1]))
    with pytest.raises(ValueError, match="Zipf exponent"):
        SyntheticCriteoDataset(_small(zipf_exponents=[-0.5]))
    with pytest.raises(ValueError, match="rank"):
        SyntheticCriteoDataset(_small(), rank=2, world_size=2)
    with pytest.raises(ValueError, match="pooling_factors"):
        SyntheticCriteoDataset(_small(pooling_factors=[0]))


class _TinyModel(torch.nn.Module):
    """Logistic regression on dense features plus a scalar embedding per row and table."""

    def __init__(self, sizes: list[int], num_dense: int) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.EmbeddingBag(n, 1, mode="mean") for n in sizes)
        for table in self.tables:
            torch.nn.init.zeros_(table.weight)
        self.dense = torch.nn.Linear(num_dense, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        logit = self.dense(batch.dense_features).squeeze(1)
        for key, table in zip(batch.sparse_features.keys(), self.tables):
            jagged = batch.sparse_features[key]
            logit = logit + table(jagged.values(), jagged.offsets()[:-1]).squeeze(1)
        return logit


def _train_and_auc(cfg: SyntheticDataConfig) -> tuple[float, float]:
    torch.manual_seed(0)
    ds = SyntheticCriteoDataset(cfg)
    model = _TinyModel(ds.num_embeddings_per_feature, cfg.num_dense_features)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    train = [ds.batch_at(i) for i in range(16)]  # 4096 samples
    for _ in range(6):
        for batch in train:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    held_out = range(1000, 1016)
    with torch.no_grad():
        scores = torch.cat([model(ds.batch_at(i)) for i in held_out])
    labels = torch.cat([ds.batch_at(i).labels for i in held_out]).long()
    oracle = torch.cat([ds.oracle_logits(i) for i in held_out])
    return float(binary_auroc(scores, labels)), float(binary_auroc(oracle, labels))


def test_labels_are_learnable_from_dense_and_sparse_features() -> None:
    cfg = _small(batch_size=256, num_sparse_features=8, num_embeddings_per_feature=[2000])
    auc, oracle_auc = _train_and_auc(cfg)
    assert auc > 0.65
    assert oracle_auc > auc - 0.02


def test_labels_are_learnable_from_sparse_features_alone() -> None:
    cfg = _small(
        batch_size=256, num_sparse_features=8, num_embeddings_per_feature=[2000], dense_signal=0.0
    )
    auc, _ = _train_and_auc(cfg)
    assert auc > 0.58


def test_torchrec_dlrm_trains_on_the_batches() -> None:
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    cfg = _small(num_sparse_features=4, num_embeddings_per_feature=[100, 200, 300, 400])
    ds = SyntheticCriteoDataset(cfg)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t_{key}", embedding_dim=8, num_embeddings=n, feature_names=[key]
            )
            for key, n in zip(ds.keys, ds.num_embeddings_per_feature)
        ]
    )
    model = DLRM(
        ebc, dense_in_features=13, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1]
    )
    batch = ds.batch_at(0)
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (64, 1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits.squeeze(1), batch.labels).backward()


@pytest.mark.parametrize("n,exponent", [(7, 0.0), (10, 1.1), (5000, 1.0), (200_000, 0.8)])
def test_zipf_rank_probabilities_are_the_sampled_law(n: int, exponent: float) -> None:
    sampler = ZipfRankSampler(n, exponent)
    p = sampler.rank_probabilities()
    assert p.shape == (n,) and p.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(np.diff(p) <= 1e-18)  # rank 0 the most likely
    draws = 2_000_000
    counts = np.bincount(sampler.sample(np.random.default_rng(1), draws), minlength=n)
    # Each rank's count against its binomial spread, head and tail alike.
    z = (counts - draws * p) / np.sqrt(draws * p * (1 - p))
    assert np.abs(z).max() < 6.0


def test_row_probabilities_follow_the_permutation() -> None:
    n = 50_000
    ds = SyntheticCriteoDataset(
        _small(num_sparse_features=1, num_embeddings_per_feature=[n], zipf_exponents=[1.1])
    )
    p = ds.row_probabilities(0)
    assert p.sum() == pytest.approx(1.0)
    assert np.array_equal(np.argsort(-p, kind="stable")[:50], ds.hottest_rows(0, 50))
