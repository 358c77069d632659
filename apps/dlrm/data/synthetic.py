"""Synthetic Criteo-shaped click data with Zipf-skewed, scattered ids and learnable labels.

Why synthetic: the memory hierarchy's behaviour depends on table sizes and on how skewed the
accesses are, which real logs fix and a generator can sweep. Three choices keep it usable at
production table sizes (tens of millions of rows) in small, constant memory:

* ranks are drawn from a bounded Zipf law by inverse CDF: an exact CDF table over the
  ``head_size`` most popular ranks plus the closed-form inverse of the continuous law
  ``x**-s`` over the rest (midpoint rule, so rank ``k`` gets ``~ k**-s``), never a vector
  of the table's size;
* a rank becomes a row id through a keyed Feistel permutation of ``[0, n)`` with cycle walking
  (a bijection computed on the fly), so hot rows are scattered over the table as hashed
  ids are in real logs, with no stored n-entry permutation;
* each row's hidden label weight is a hash of (seed, table, id), again O(1) memory.

Batch ``i`` of rank ``r`` in a world of ``W`` is global batch ``i * W + r`` and depends only on
(seed, split, that number): ranks see disjoint draws, their union equals the single-process
stream, and a resumed run can start at any batch without replaying the earlier ones. The
held-out split draws from a seed stream of its own, so it never repeats a training batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.data._common import (
    check_positive,
    check_rank,
    check_sizes,
    feature_names,
    per_table,
    worker_shard,
)
from apps.dlrm.data.config import Split, SyntheticDataConfig

logger = logging.getLogger(__name__)

# Domain-separation tags for the seed streams, so that e.g. table 3's permutation key and
# batch 3's sample stream never coincide.
_TAG_PERMUTATION = 1
_TAG_ROW_WEIGHT = 2
_TAG_DENSE_MODEL = 3
_TAG_BATCH = 4
_TAG_EVAL_BATCH = 5

_U64 = np.uint64


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer: a bijection of uint64 whose output bits all depend on all input bits."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _derive_key(seed: int, *parts: int) -> int:
    """A 64-bit key that depends on (seed, parts) through numpy's SeedSequence hashing."""
    state = np.random.SeedSequence([seed, *parts]).generate_state(1, np.uint64)
    return int(state[0])


class FeistelPermutation:
    """A keyed pseudo-random bijection of ``[0, n)``, evaluated lazily on arrays of ids.

    An (unbalanced) Feistel network permutes the ``m``-bit integers, ``m = ceil(log2 n)``;
    ids that land in ``[n, 2**m)`` are re-encrypted until they fall in range (cycle walking),
    which stays a bijection of ``[0, n)`` and takes fewer than 2 rounds on average since
    ``2**m < 2 n``. Memory is a handful of round keys whatever ``n`` is.

    Example::

        perm = FeistelPermutation(10_000_000, key=7)
        perm(np.arange(5))  # five distinct ids scattered over [0, 10M)
    """

    def __init__(self, n: int, key: int, rounds: int = 4) -> None:
        check_positive(n, "n")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._left_bits = bits // 2
        self._right_bits = bits - self._left_bits
        self._round_keys = np.random.SeedSequence(key).generate_state(rounds, np.uint64)

    def _encrypt(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        left_bits, right_bits = self._left_bits, self._right_bits
        left = x >> _U64(right_bits)
        right = x & _U64((1 << right_bits) - 1)
        for round_key in self._round_keys:
            mixed = _mix64(right ^ round_key) & _U64((1 << left_bits) - 1)
            left, right = right, left ^ mixed
            left_bits, right_bits = right_bits, left_bits
        return (left << _U64(right_bits)) | right

    def __call__(self, ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Maps ids in ``[0, n)`` to their images in ``[0, n)``."""
        x = np.asarray(ids, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"ids must lie in [0, {self.n})")
        y = self._encrypt(x.astype(np.uint64))
        pending = np.flatnonzero(y >= _U64(self.n))
        while pending.size:
            walked = self._encrypt(y[pending])
            y[pending] = walked
            pending = pending[walked >= _U64(self.n)]
        return y.astype(np.int64)


def _power_integral(a: float, b: float, s: float) -> float:
    """Integral of ``x**-s`` over ``[a, b]``."""
    if abs(1.0 - s) < 1e-9:
        return math.log(b / a)
    return float((b ** (1.0 - s) - a ** (1.0 - s)) / (1.0 - s))


class ZipfRankSampler:
    """Draws 0-based ranks of a bounded Zipf law ``P(rank k) ~ (k + 1)**-s``, ``k < n``.

    The ``head_size`` most popular ranks are sampled exactly from a stored CDF; the tail,
    where consecutive probabilities differ by less than ``s / head_size``, from the inverse
    CDF of the continuous density ``x**-s`` on ``[head_size + 0.5, n + 0.5]``, rounded
    (the midpoint rule gives rank ``k`` a mass of ``~ k**-s``). Memory: ``head_size`` floats.
    ``s = 0`` is the uniform law.

    Example::

        sampler = ZipfRankSampler(10_000_000, exponent=1.1)
        ranks = sampler.sample(np.random.default_rng(0), 4096)
    """

    def __init__(self, n: int, exponent: float, head_size: int = 1024) -> None:
        check_positive(n, "n")
        if not math.isfinite(exponent) or exponent < 0:
            raise ValueError(f"Zipf exponent must be finite and >= 0, got {exponent}")
        self.n = n
        self.exponent = exponent
        self._head = min(n, head_size)
        head_weights = np.arange(1, self._head + 1, dtype=np.float64) ** -exponent
        head_cdf = np.cumsum(head_weights)
        tail = _power_integral(self._head + 0.5, n + 0.5, exponent) if self._head < n else 0.0
        self._total = float(head_cdf[-1]) + tail
        self._head_cdf = head_cdf / self._total
        self._head_mass = float(self._head_cdf[-1])

    def rank_probabilities(self) -> npt.NDArray[np.float64]:
        """Each rank's probability under this sampler, exactly as :meth:`sample` draws it (the
        head's stored masses, then each tail rank's share of the continuous density over
        ``[rank + 0.5, rank + 1.5)``): ``n`` floats that sum to 1."""
        if self.exponent == 0.0:
            return np.full(self.n, 1.0 / self.n)
        out = np.empty(self.n, dtype=np.float64)
        out[: self._head] = np.diff(self._head_cdf, prepend=0.0)
        if self._head < self.n:
            edges = np.arange(self._head, self.n + 1, dtype=np.float64) + 0.5
            s = self.exponent
            if abs(1.0 - s) < 1e-9:
                antiderivative = np.log(edges)
            else:
                antiderivative = edges ** (1.0 - s) / (1.0 - s)
            out[self._head :] = np.diff(antiderivative) / self._total
        return out

    def sample(self, rng: np.random.Generator, size: int) -> npt.NDArray[np.int64]:
        """``size`` ranks in ``[0, n)``; rank 0 is the most popular."""
        if self.exponent == 0.0:
            return rng.integers(0, self.n, size=size, dtype=np.int64)
        u = rng.random(size)
        ranks = np.empty(size, dtype=np.int64)
        in_head = u < self._head_mass
        ranks[in_head] = np.searchsorted(self._head_cdf, u[in_head], side="right")
        in_tail = ~in_head
        if in_tail.any():
            # Unnormalized mass beyond the head, inverted through the continuous CDF.
            v = (u[in_tail] - self._head_mass) * self._total
            start = self._head + 0.5
            s = self.exponent
            if abs(1.0 - s) < 1e-9:
                x = start * np.exp(v)
            else:
                x = (start ** (1.0 - s) + (1.0 - s) * v) ** (1.0 / (1.0 - s))
            one_based = np.clip(np.floor(x + 0.5), self._head + 1, self.n)
            ranks[in_tail] = one_based.astype(np.int64) - 1
        return ranks


class SyntheticCriteoDataset(IterableDataset[Batch]):
    """Criteo-shaped batches: ``[B, D]`` dense floats, a ``T``-key KJT of ids, ``[B]`` labels.

    Labels come from a fixed hidden model, so a DLRM can learn them: the logit is
    ``label_bias + dense_signal * <z, v> + sparse_signal / sqrt(T) * sum_t mean(w_t(ids))``,
    where ``z ~ N(0, I)`` are latent dense values (the model sees the Criteo-like
    ``log1p(exp(mu + sigma * z))``), ``v`` a fixed unit vector and ``w_t(id)`` a hashed
    per-row weight of unit variance; the label is Bernoulli(sigmoid(logit)).

    Args:
        config: data shape, skew, pooling, seed and label model.
        rank: this process's rank.
        world_size: number of ranks.
        start_batch: first batch index to yield (to resume a run).
        split: the training batches or the held-out ones (as many, never the same draws).

    Example::

        ds = SyntheticCriteoDataset(SyntheticDataConfig(batch_size=256, num_batches=10))
        batch = next(iter(ds))
    """

    def __init__(
        self,
        config: SyntheticDataConfig,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
        split: Split | str = Split.TRAIN,
    ) -> None:
        super().__init__()
        self.split = Split.parse(split)
        self._batch_tag = _TAG_BATCH if self.split is Split.TRAIN else _TAG_EVAL_BATCH
        check_rank(rank, world_size)
        check_positive(config.batch_size, "batch_size")
        check_positive(config.num_sparse_features, "num_sparse_features")
        if config.num_batches < 0 or config.num_dense_features < 0 or start_batch < 0:
            raise ValueError("num_batches, num_dense_features and start_batch must be >= 0")
        if config.seed < 0:
            raise ValueError(f"seed must be >= 0, got {config.seed}")
        num_tables = config.num_sparse_features
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        self.keys = feature_names(num_tables)
        self.num_embeddings_per_feature = [
            int(n)
            for n in per_table(
                config.num_embeddings_per_feature, num_tables, "num_embeddings_per_feature"
            )
        ]
        check_sizes(self.num_embeddings_per_feature)
        exponents = per_table(config.zipf_exponents, num_tables, "zipf_exponents")
        self.pooling_factors = [
            int(p) for p in per_table(config.pooling_factors, num_tables, "pooling_factors")
        ]
        for p in self.pooling_factors:
            check_positive(p, "pooling_factors")
        self._samplers = [
            ZipfRankSampler(n, float(s)) for n, s in zip(self.num_embeddings_per_feature, exponents)
        ]
        self._permutations = [
            FeistelPermutation(n, _derive_key(config.seed, _TAG_PERMUTATION, t))
            for t, n in enumerate(self.num_embeddings_per_feature)
        ]
        self._row_weight_keys = [
            np.uint64(_derive_key(config.seed, _TAG_ROW_WEIGHT, t)) for t in range(num_tables)
        ]
        model_rng = np.random.default_rng([config.seed, _TAG_DENSE_MODEL])
        num_dense = config.num_dense_features
        self._dense_mu = model_rng.uniform(0.0, 3.0, num_dense)
        self._dense_sigma = model_rng.uniform(0.5, 1.5, num_dense)
        direction = model_rng.standard_normal(num_dense)
        norm = float(np.linalg.norm(direction))
        self._dense_direction = direction / norm if norm > 0 else direction

    def __len__(self) -> int:
        return max(0, self.config.num_batches - self.start_batch)

    def __iter__(self) -> Iterator[Batch]:
        # DataLoader workers take every num_workers-th batch; the loader interleaves them
        # round-robin, so the order matches a single-process run.
        worker, num_workers = worker_shard()
        for index in range(self.start_batch + worker, self.config.num_batches, num_workers):
            yield self.batch_at(index)

    def batch_at(self, index: int) -> Batch:
        """Batch ``index`` of this rank: a pure function of (seed, split, index, rank,
        world_size)."""
        return self._generate(index)[0]

    def oracle_logits(self, index: int) -> torch.Tensor:
        """The hidden model's logits for batch ``index``: the best score any model can reach.

        Its AUC on the batch's labels is the ceiling a trained model's AUC approaches.
        """
        return torch.from_numpy(self._generate(index)[1].astype(np.float32))

    def hottest_rows(self, table: int, count: int) -> npt.NDArray[np.int64]:
        """Ids of the ``count`` most frequently drawn rows of ``table``, hottest first."""
        n = self.num_embeddings_per_feature[table]
        return self._permutations[table](np.arange(min(count, n)))

    def row_probabilities(self, table: int) -> npt.NDArray[np.float64]:
        """Each row's probability per id drawn for ``table`` (by id; ``n`` floats, 8 bytes a
        row): every batch draws its ids independently from this law."""
        p = self._samplers[table].rank_probabilities()
        out = np.empty_like(p)
        out[self._permutations[table](np.arange(p.size))] = p
        return out

    def row_weights(self, table: int, ids: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Hidden label weights of rows ``ids`` of ``table``: uniform, mean 0, variance 1."""
        h = _mix64(np.asarray(ids, dtype=np.int64).astype(np.uint64) ^ self._row_weight_keys[table])
        unit = (h >> _U64(11)).astype(np.float64) * 2.0**-53
        return (2.0 * unit - 1.0) * math.sqrt(3.0)

    def _generate(self, index: int) -> tuple[Batch, npt.NDArray[np.float64]]:
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        cfg = self.config
        batch_size = cfg.batch_size
        global_index = index * self.world_size + self.rank
        rng = np.random.default_rng([cfg.seed, self._batch_tag, global_index])

        latent = rng.standard_normal((batch_size, cfg.num_dense_features))
        dense = np.log1p(np.exp(self._dense_mu + self._dense_sigma * latent)).astype(np.float32)
        logits = cfg.label_bias + cfg.dense_signal * (latent @ self._dense_direction)

        all_values: list[npt.NDArray[np.int64]] = []
        all_lengths: list[npt.NDArray[np.int32]] = []
        sparse_sum = np.zeros(batch_size)
        for t, pooling in enumerate(self.pooling_factors):
            if cfg.random_pooling and pooling > 1:
                lengths = rng.integers(1, 2 * pooling, size=batch_size, dtype=np.int32)
            else:
                lengths = np.full(batch_size, pooling, dtype=np.int32)
            ranks = self._samplers[t].sample(rng, int(lengths.sum()))
            ids = self._permutations[t](ranks)
            weights = self.row_weights(t, ids)
            if pooling == 1:
                sparse_sum += weights
            else:
                bag = np.repeat(np.arange(batch_size), lengths)
                sparse_sum += np.bincount(bag, weights=weights, minlength=batch_size) / lengths
            all_values.append(ids)
            all_lengths.append(lengths)
        logits += cfg.sparse_signal / math.sqrt(len(self.keys)) * sparse_sum
        labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)

        batch = Batch(
            dense_features=torch.from_numpy(dense),
            sparse_features=KeyedJaggedTensor(
                keys=self.keys,
                values=torch.from_numpy(np.concatenate(all_values)),
                lengths=torch.from_numpy(np.concatenate(all_lengths)),
            ),
            labels=torch.from_numpy(labels),
        )
        return batch, logits
