"""A tiered table's ``weight`` as code written for TorchRec's FUSED kernel indexes it.

TorchRec's sharded EBC/EC register each FUSED table's local shard as ``embedding_bags.<table>
.weight`` (``embeddings.<table>.weight``), a parameter aliasing the kernel's rows, and some of
TorchRec reads and writes rows through it by index: its managed-collision modules, which reset
the rows of the slots they give to new ids with ``weight[slots] = init_fn(weight[slots])``
(also through ``.data``). A tiered table's rows are not one tensor (most sit on a tier, the
newest in the cache), so its ``weight`` is a :class:`TierRowsParameter`: indexing it by row
reads the rows where they live, and assigning to it sets them there (the cache slot of a cached
row, else the tier; see :meth:`TieredTableGroup.set_rows`). Nothing else is supported on it,
each other operation naming the table; the whole table is read and written through
``state_dict()``.

It is not registered as a parameter (no optimizer, ``named_parameters`` or state dict sees it):
``Module.get_parameter`` finds it as a plain attribute.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup

_TENSOR: Any = torch.Tensor  # (its properties' getters, untyped to mypy)
# What may be asked of the parameter besides rows: its shape, dtype and device.
_METADATA = {
    *(getattr(_TENSOR, name).__get__ for name in ("shape", "dtype", "device", "ndim")),
    *(getattr(_TENSOR, name).__get__ for name in ("requires_grad", "is_cuda")),
    _TENSOR.size,
    _TENSOR.dim,
    _TENSOR.numel,
    _TENSOR.__len__,
}


class TierRowsParameter(nn.Parameter):
    """Rows of shard ``index`` of ``group`` (one table's only shard on this rank), read and
    set by row index: ``weight[ids]``, ``weight[ids] = rows``, the same through ``.data``;
    ``ids`` an integer or boolean tensor, a list, an int or a slice over the shard's local
    rows."""

    _group: TieredTableGroup
    _index: int
    _table: str

    def __new__(cls, group: TieredTableGroup, index: int) -> TierRowsParameter:
        shard = group.shards[index]
        dtype, device = shard.weight_slots.dtype, shard.weight_slots.device
        # One element standing for (rows, cols): shape, dtype and device are the table's.
        base = torch.empty(1, dtype=dtype, device=device).expand(shard.local_rows, shard.cols)
        param = super().__new__(cls, base, requires_grad=False)
        param._group, param._index, param._table = group, index, shard.name
        return param

    @property  # type: ignore[override]  # a tensor's .data: the rows themselves here
    def data(self) -> TierRowsParameter:
        return self

    @data.setter
    def data(self, value: Any) -> None:
        raise NotImplementedError(self._unsupported("replacing .data"))

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]  # torch's stub names its keyword oddly
        shard = self._group.shards[self._index]
        return (
            f"TierRowsParameter(table={self._table!r}, rows={shard.local_rows}, "
            f"cols={shard.cols}, dtype={shard.weight_slots.dtype})"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise NotImplementedError(self._unsupported("copying"))

    def __reduce_ex__(self, proto: Any) -> Any:
        raise NotImplementedError(self._unsupported("pickling"))

    def _unsupported(self, what: str) -> str:
        return (
            f"table {self._table!r}: its weight lives on a tier; {what} is not supported on it "
            "(index it by rows to read or set them, or use state_dict() for the whole table)"
        )

    def _row_ids(self, key: Any) -> tuple[torch.Tensor, bool]:
        """The local row ids ``key`` selects, and whether it selects one row (an int)."""
        rows = self._group.shards[self._index].local_rows
        if isinstance(key, tuple) and len(key) == 1:
            key = key[0]
        if isinstance(key, int) and not isinstance(key, bool):
            return torch.tensor([key + rows if key < 0 else key]), True
        if isinstance(key, slice):
            return torch.arange(*key.indices(rows)), False
        if isinstance(key, (torch.Tensor, list)):
            ids = torch.as_tensor(key)
            if ids.dtype == torch.bool:
                if ids.shape != (rows,):
                    raise IndexError(
                        f"table {self._table!r}: a mask over its rows has {rows} entries, "
                        f"not {tuple(ids.shape)}"
                    )
                return torch.nonzero(ids.to("cpu")).flatten(), False
            if not ids.is_floating_point() and not ids.is_complex():
                one = ids.dim() == 0
                ids = ids.to("cpu", torch.int64).flatten()
                return torch.where(ids < 0, ids + rows, ids), one
        raise NotImplementedError(self._unsupported(f"indexing by {type(key).__name__}"))

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:  # answered by the plain tensor standing for the rows
            return torch.Tensor.__torch_function__(func, (torch.Tensor,), args, kwargs)  # type: ignore[no-untyped-call]  # unannotated in torch
        param = next(a for a in args if isinstance(a, TierRowsParameter))
        if func is torch.Tensor.__getitem__ and args[0] is param:
            ids, one = param._row_ids(args[1])
            rows = param._group.read_weights(param._index, ids)
            return rows[0] if one else rows
        if func is torch.Tensor.__setitem__ and args[0] is param:
            ids, _ = param._row_ids(args[1])
            value = torch.as_tensor(args[2])
            param._group.set_rows(param._index, ids, weights=value)
            return None
        raise NotImplementedError(param._unsupported(getattr(func, "__name__", str(func))))
