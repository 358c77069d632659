"""Small shared vocabulary: tier names, storage dtypes and the row layout every tier stores.

Everything here is a frozen value type so it can travel inside sharding plans, configs and
file headers without surprises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
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
    """Element type a table's weights are stored in (its optimizer state is always fp32, see
    :data:`STATE_DTYPE`). Rows are always handed out as float32."""

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


STATE_DTYPE = StorageDType.FP32
"""Element type of the optimizer state on every tier: fbgemm keeps a table's optimizer state in
fp32 whatever its weights' type, so a tier that narrowed it would train other values."""

WORD_BYTES = 4
"""Rows are stored in 4-byte words: fp32 values, or fp16 weights two to a word (the weights
padded to a whole word), then the fp32 optimizer state."""

WordArray = npt.NDArray[Any]
FloatRows = npt.NDArray[np.float32]


def stored_row_bytes(dim: int, state_width: int, weight_bytes: int) -> int:
    """Bytes a tier stores per row: ``dim`` weights of ``weight_bytes`` each, padded to a whole
    4-byte word, then ``state_width`` fp32 optimizer-state values (see :data:`STATE_DTYPE`)."""
    return -(-dim * weight_bytes // WORD_BYTES) * WORD_BYTES + state_width * STATE_DTYPE.itemsize


@dataclass(frozen=True)
class RowLayout:
    """Shape of one stored table: each row holds ``dim`` weights followed by ``state_width``
    optimizer-state values (e.g. 1 for row-wise Adagrad, ``dim`` for Adagrad, 0 for SGD), so a
    single read brings a row's weight and its optimizer state together.

    On a tier a row is :attr:`row_words` 4-byte words: the weights at ``dtype`` (fp16 weights
    two to a word, padded to a whole word), then the state in fp32 (:data:`STATE_DTYPE`), as
    fbgemm keeps them. Stores hand rows in and out as float32 (``row_width`` values: weights,
    then state), which holds either type exactly; :meth:`encode` and :meth:`decode` convert.
    An fp32 table's words are its values, so both are views for it.

    Args:
        num_rows: rows in the table (or in this rank's shard of it).
        dim: embedding dimension.
        state_width: optimizer-state values stored after the weights of each row.
        dtype: the weights' storage element type.
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
        """Values per row as stores hand them out (float32): weights then optimizer state."""
        return self.dim + self.state_width

    @property
    def state_dtype(self) -> StorageDType:
        return STATE_DTYPE

    @property
    def packed(self) -> bool:
        """Whether the weights are narrower than a word (so words are not the row's values)."""
        return self.dtype is not StorageDType.FP32

    @property
    def weight_words(self) -> int:
        """Words holding the weights (fp16 weights two to a word, the last one padded)."""
        return -(-self.dim * self.dtype.itemsize // WORD_BYTES)

    @property
    def row_words(self) -> int:
        """Words per stored row: the weights', then one per optimizer-state value."""
        return self.weight_words + self.state_width

    @property
    def row_bytes(self) -> int:
        return stored_row_bytes(self.dim, self.state_width, self.dtype.itemsize)

    @property
    def total_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def word_dtype(self) -> np.dtype[Any]:
        """The numpy type of a stored word: float32 for an fp32 table (its words are its
        values), else uint32 (raw bits: a copy never mistakes them for numbers)."""
        return np.dtype(np.uint32) if self.packed else np.dtype(np.float32)

    def decode(self, words: WordArray, out: FloatRows | None = None) -> FloatRows:
        """Stored rows ``(n, row_words)`` (:attr:`word_dtype`, or raw bytes ``(n, row_bytes)``)
        as float32 rows ``(n, row_width)``: a view for an fp32 table unless ``out`` is given,
        which it fills."""
        words = _as_words(words, self)
        if not self.packed:
            if out is None:
                return words.view(np.float32)
            out[...] = words.view(np.float32)
            return out
        if out is None:
            out = np.empty((words.shape[0], self.row_width), dtype=np.float32)
        ww = self.weight_words
        out[:, : self.dim] = words[:, :ww].view(self.dtype.numpy_dtype)[:, : self.dim]
        out[:, self.dim :] = words[:, ww:].view(np.float32)
        return out

    def encode(self, rows: npt.ArrayLike) -> WordArray:
        """Float32 rows ``(n, row_width)`` as stored words ``(n, row_words)``, contiguous (the
        rows themselves for an fp32 table when they already are)."""
        values = np.ascontiguousarray(rows, dtype=np.float32)
        if not self.packed:
            return values
        n = values.shape[0]
        out = np.zeros((n, self.row_words), dtype=np.uint32)
        ww = self.weight_words
        out[:, :ww].view(self.dtype.numpy_dtype)[:, : self.dim] = values[:, : self.dim]
        out[:, ww:] = values[:, self.dim :].view(np.uint32)
        return out

    def column_at(self, offset: int) -> int:
        """The row value (``0 .. row_width``) stored at byte ``offset`` of a row: a weight's
        index, or ``dim +`` an optimizer-state value's."""
        weights = self.weight_words * WORD_BYTES
        if offset < weights:
            return offset // self.dtype.itemsize
        return self.dim + (offset - weights) // STATE_DTYPE.itemsize

    def byte_offset(self, column: int) -> int:
        """Where row value ``column`` starts within a stored row (see :meth:`column_at`)."""
        if column < self.dim:
            return column * self.dtype.itemsize
        return self.weight_words * WORD_BYTES + (column - self.dim) * STATE_DTYPE.itemsize


def _as_words(rows: WordArray, layout: RowLayout) -> WordArray:
    if rows.dtype == np.uint8:
        return rows.view(layout.word_dtype)
    return rows.view(layout.word_dtype) if rows.dtype != layout.word_dtype else rows
