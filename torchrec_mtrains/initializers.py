"""Table initializers that give every row the same values wherever the table is placed.

TorchRec initializes a table with its config's ``init_fn`` applied to the table's sharded weight
(every local shard at once); a tiered table is initialized chunk by chunk straight on its tier.
A random ``init_fn`` then draws different values for the same row under different placements
or shardings, so two plans of one model never start from the same weights.
:class:`RowSeededUniform` draws each row from a generator seeded by the table's seed and the
row's block of rows: the values of row ``r`` depend on ``r`` alone, whether it is filled in a
table-wise shard, a row- or column-wise shard, or one chunk of a tiered table. Benchmarks and
the parity sweep use it to start a FUSED and a tiered model from the same weights without
copying tables that do not fit in memory.

A virtual table (ids from a space of up to 2**50, rows made on first use) needs the values of
any scattered set of ids at once, which block seeding makes cost a whole block of rows per id:
:class:`IdSeededUniform` hashes ``(seed, id, column)`` to each value instead, so a row costs its
own ``dim`` values wherever and whenever it is made, and a FUSED table filled by it (the
parity reference) holds the same rows.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from torchrec_mtrains._compat.torch_internals import ShardedTensor
from torchrec_mtrains.cache.kernels import NUMBA_AVAILABLE, _jit, splitmix64_word

BLOCK_ROWS = 4096  # rows drawn from one generator: the granularity of the seeding


@runtime_checkable
class RowAddressedInit(Protocol):
    """An ``init_fn`` that can fill any rows and columns of its table by their place in it,
    which a tiered table's chunked initialization calls instead of ``init_fn(chunk)``."""

    def __call__(self, weight: Any) -> Any: ...

    def fill(self, rows: torch.Tensor, first_row: int, first_col: int = 0) -> None: ...


@runtime_checkable
class IdAddressedInit(RowAddressedInit, Protocol):
    """A :class:`RowAddressedInit` that also fills rows given by arbitrary ids: what a virtual
    table calls when it makes the rows of ids trained for the first time."""

    def fill_ids(self, rows: torch.Tensor, ids: torch.Tensor, first_col: int = 0) -> None: ...


def fill_weight(init: RowAddressedInit, weight: Any) -> Any:
    """Fills ``weight`` with ``init`` by place: each local shard of a ``ShardedTensor`` at its
    offsets, a plain tensor as the whole table; nothing for a meta or empty tensor (a module
    built on meta, a rank without the table)."""
    if isinstance(weight, torch.Tensor) and (weight.is_meta or weight.numel() == 0):
        return weight
    with torch.no_grad():
        if isinstance(weight, ShardedTensor):
            for shard in weight.local_shards():
                row, col = [*shard.metadata.shard_offsets, 0, 0][:2]
                init.fill(shard.tensor, int(row), int(col))
        else:
            init.fill(weight, 0, 0)
    return weight


@dataclass(frozen=True)
class RowSeededUniform:
    """``U(low, high)`` per element, the same for a row whatever shard or chunk holds it.

    Args:
        seed: the table's seed (give each table its own).
        dim: the table's embedding dim (column shards take their columns of full rows).
        low / high: the bounds.

    Example::

        EmbeddingBagConfig(name="t0", num_embeddings=10**7, embedding_dim=64,
                           feature_names=["f0"], init_fn=RowSeededUniform(seed=0, dim=64))
    """

    seed: int
    dim: int
    low: float = -0.01
    high: float = 0.01

    def __call__(self, weight: Any) -> Any:
        """TorchRec's entry: fills a table's weight, a ``ShardedTensor`` (each local shard at
        its offsets) or a whole table as one tensor."""
        return fill_weight(self, weight)

    def fill(self, rows: torch.Tensor, first_row: int, first_col: int = 0) -> None:
        """Fills ``rows`` with the table's rows ``first_row ..`` and its columns
        ``first_col ..``, in place."""
        count, cols = rows.shape
        if first_col + cols > self.dim:
            raise ValueError(
                f"columns {first_col}..{first_col + cols} exceed the table's dim {self.dim}"
            )
        out = rows
        done = 0
        while done < count:
            row = first_row + done
            block, start = divmod(row, BLOCK_ROWS)
            take = min(count - done, BLOCK_ROWS - start)
            values = self._block(block)[start : start + take, first_col : first_col + cols]
            out[done : done + take].copy_(values.to(out.dtype))
            done += take

    def _block(self, block: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + block) % (2**63))
        values = torch.empty(BLOCK_ROWS, self.dim, dtype=torch.float32)
        return values.uniform_(self.low, self.high, generator=g)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_UNIT = np.float32(2.0**-24)


def splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer, elementwise (uint64 arithmetic wraps, as the hash needs)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


@_jit
def _fill_uniform(
    keys: npt.NDArray[np.uint64],
    first_col: int,
    low: np.float32,
    span: np.float32,
    out: npt.NDArray[np.float32],
) -> None:
    """``out[i, j] = low + span * unit`` with ``unit`` the top 24 bits of
    ``splitmix64(keys[i] + (first_col + j) * golden)`` over 2**24, all in float32: what
    :meth:`IdSeededUniform.fill_ids` computes with numpy, in one pass without the GIL (a
    virtual table fills its new rows on the tier worker, beside the training thread)."""
    for i in range(out.shape[0]):
        key = keys[i]
        for j in range(out.shape[1]):
            x = splitmix64_word(key + np.uint64(first_col + j) * _GOLDEN)
            unit = np.float32(x >> np.uint64(40)) * _UNIT
            out[i, j] = low + span * unit


@dataclass(frozen=True)
class IdSeededUniform:
    """``U(low, high)`` per element, a function of ``(seed, id, column)`` alone: the initial
    row of an id is the same in a virtual table (made when the id is first trained, on any
    rank, in any order) and in a FUSED table filled by :meth:`fill` (row ``r`` is id ``r``).

    Each value is the top 24 bits of a SplitMix64 hash, scaled in float32, so it is exact and
    platform independent. :meth:`for_config` takes TorchRec's range for a table (its
    ``weight_init_min`` / ``weight_init_max``, by default ``±sqrt(1 / num_embeddings)``).

    Args:
        seed: the table's seed (give each table its own).
        dim: the table's embedding dim (column shards take their columns of full rows).
        low / high: the bounds.
    """

    seed: int
    dim: int
    low: float = -0.01
    high: float = 0.01

    @classmethod
    def for_config(cls, config: Any, seed: int | None = None) -> IdSeededUniform:
        """The initializer TorchRec's default would draw from for ``config`` (an embedding
        config), seeded by ``seed`` or else by the table's name."""
        if seed is None:
            seed = zlib.crc32(config.name.encode())
        return cls(
            seed=seed,
            dim=int(config.embedding_dim),
            low=float(config.get_weight_init_min()),
            high=float(config.get_weight_init_max()),
        )

    def __call__(self, weight: Any) -> Any:
        """TorchRec's entry: fills a table's weight, a ``ShardedTensor`` (each local shard at
        its offsets) or a whole table as one tensor."""
        return fill_weight(self, weight)

    def fill(self, rows: torch.Tensor, first_row: int, first_col: int = 0) -> None:
        """Fills ``rows`` with the table's rows ``first_row ..`` (ids), columns
        ``first_col ..``, in place."""
        ids = torch.arange(first_row, first_row + rows.shape[0], dtype=torch.int64)
        self.fill_ids(rows, ids, first_col)

    def fill_ids(self, rows: torch.Tensor, ids: torch.Tensor, first_col: int = 0) -> None:
        """Fills ``rows[i]`` with id ``ids[i]``'s initial values, columns ``first_col ..``."""
        count, cols = rows.shape
        if first_col + cols > self.dim:
            raise ValueError(
                f"columns {first_col}..{first_col + cols} exceed the table's dim {self.dim}"
            )
        if ids.shape != (count,):
            raise ValueError(f"{count} rows need {count} ids, got shape {tuple(ids.shape)}")
        if count == 0:
            return
        id_words = ids.to("cpu", torch.int64).numpy().astype(np.uint64)
        seed = np.uint64(self.seed % 2**64)
        row_keys = splitmix64(id_words ^ splitmix64(np.full(1, seed, dtype=np.uint64)))
        span = np.float32(self.high) - np.float32(self.low)
        if NUMBA_AVAILABLE:
            values = np.empty((count, cols), dtype=np.float32)
            _fill_uniform(row_keys, first_col, np.float32(self.low), span, values)
        else:
            columns = np.arange(first_col, first_col + cols, dtype=np.uint64)
            words = splitmix64(row_keys[:, None] + columns[None, :] * _GOLDEN)
            unit = (words >> np.uint64(40)).astype(np.float32) * _UNIT
            values = np.float32(self.low) + span * unit
        with torch.no_grad():
            rows.copy_(torch.from_numpy(values).to(rows.dtype))
