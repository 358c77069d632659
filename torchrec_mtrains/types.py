"""Small shared vocabulary: tier names, storage dtypes and the row layout every tier stores.

Everything here is a frozen value type so it can travel inside sharding plans, configs and
file headers without surprises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

_E = TypeVar("_E", bound=enum.Enum)


def parse_choice(kind: type[_E], value: str | _E, what: str) -> _E:
    """``value`` as a member of the enum ``kind``; ``ValueError`` naming ``what`` and the
    allowed values otherwise."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in kind)
        raise ValueError(f"unknown {what} {value!r}; expected one of: {allowed}") from None


class Tier(str, enum.Enum):
    """Where a table's rows live. The string values are the names used in configs and plans."""

    HBM = "hbm"
    DRAM = "dram"
    BYTE_SCM = "byte_scm"
    BLOCK_SCM = "block_scm"

    @classmethod
    def parse(cls, value: str | Tier) -> Tier:
        """Returns the tier named ``value``; raises ``ValueError`` listing the valid names."""
        return parse_choice(cls, value, "tier")


class StorageDType(str, enum.Enum):
    """Element type rows are stored in. Rows are always handed out as float32."""

    FP32 = "fp32"
    FP16 = "fp16"

    @property
    def numpy_dtype(self) -> np.dtype[np.floating]:
        return np.dtype(np.float32) if self is StorageDType.FP32 else np.dtype(np.float16)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self is StorageDType.FP32 else torch.float16

    @property
    def itemsize(self) -> int:
        return 4 if self is StorageDType.FP32 else 2

    @property
    def code(self) -> int:
        """Stable integer used in file headers."""
        return 1 if self is StorageDType.FP32 else 2

    @classmethod
    def from_code(cls, code: int) -> StorageDType:
        for member in cls:
            if member.code == code:
                return member
        raise ValueError(f"unknown storage dtype code {code}")

    @classmethod
    def parse(cls, value: str | StorageDType | torch.dtype) -> StorageDType:
        if isinstance(value, StorageDType):
            return value
        if value == torch.float32:
            return cls.FP32
        if value == torch.float16:
            return cls.FP16
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown storage dtype {value!r}; expected fp32 or fp16") from None


@dataclass(frozen=True)
class RowLayout:
    """Shape of one stored table: each row holds ``dim`` weights followed by ``state_width``
    optimizer-state values (e.g. 1 for row-wise Adagrad, ``dim`` for Adagrad, 0 for SGD), so a
    single read brings a row's weight and its optimizer state together.

    Args:
        num_rows: rows in the table (or in this rank's shard of it).
        dim: embedding dimension.
        state_width: optimizer-state values stored after the weights of each row.
        dtype: storage element type; reads always return float32.
    """

    num_rows: int
    dim: int
    state_width: int = 0
    dtype: StorageDType = StorageDType.FP32

    def __post_init__(self) -> None:
        if self.num_rows <= 0:
            raise ValueError(f"num_rows must be positive, got {self.num_rows}")
        if self.dim <= 0:
            raise ValueError(f"dim must be positive, got {self.dim}")
        if self.state_width < 0:
            raise ValueError(f"state_width must be >= 0, got {self.state_width}")
        object.__setattr__(self, "dtype", StorageDType.parse(self.dtype))

    @property
    def row_width(self) -> int:
        """Values per stored row: weights then optimizer state."""
        return self.dim + self.state_width

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return self.num_rows * self.row_bytes
