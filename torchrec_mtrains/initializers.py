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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from torchrec_mtrains._compat.torch_internals import ShardedTensor

BLOCK_ROWS = 4096  # rows drawn from one generator: the granularity of the seeding


@runtime_checkable
class RowAddressedInit(Protocol):
    """An ``init_fn`` that can fill any rows and columns of its table by their place in it,
    which a tiered table's chunked initialization calls instead of ``init_fn(chunk)``."""

    def __call__(self, weight: Any) -> Any: ...

    def fill(self, rows: torch.Tensor, first_row: int, first_col: int = 0) -> None: ...


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
        with torch.no_grad():
            if isinstance(weight, ShardedTensor):
                for shard in weight.local_shards():
                    row, col = [*shard.metadata.shard_offsets, 0, 0][:2]
                    self.fill(shard.tensor, int(row), int(col))
            else:
                self.fill(weight, 0, 0)
        return weight

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
