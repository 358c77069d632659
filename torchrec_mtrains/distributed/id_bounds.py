"""The bounds check a tiered sharded module applies to each batch entering it, before the
input distribution, for every table it holds (TorchRec's kernels and the tiered ones).

fbgemm checks ids inside each TBE, after the input distribution and per kernel; a tiered table
plans, loads and writes rows on the host before its TBE runs, so an id past its table must be
caught earlier, while ids are still global whatever the sharding. :class:`IdBoundsCheck` does
it with one min/max per feature and works out the details only for a batch that fails.

On an accelerator that check would wait for the device once a batch (its verdict decides
whether the batch may go on). :class:`HostBoundsCheck` avoids that: a pipeline checks each batch
while it is still on the host, before copying it to the device, and vouches for the copy, which
the module then lets in unchecked. A batch that fails on the host is not vouched for; the
module checks it again on the device and raises (or replaces its ids) exactly where it would
have, so the host check changes when ids are read, never what a batch does.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.distributed.options import BoundsCheck
from torchrec_mtrains.distributed.tiered_tables import TableIdError

__all__ = ["HostBoundsCheck", "IdBoundsCheck", "OutOfRangeIdError"]


class _Movable(Protocol):
    """A batch that moves to a device as TorchRec's ``Pipelineable`` batches do."""

    def to(self, device: torch.device, non_blocking: bool = ...) -> Any: ...


B = TypeVar("B", bound=_Movable)

logger: logging.Logger = logging.getLogger(__name__)


class OutOfRangeIdError(TableIdError):
    """A batch entering a sharded module holds row ids outside their tables; it was refused
    before any lookup (with :attr:`BoundsCheck.ERROR`), so nothing was read, trained or
    written.

    Attributes:
        table: the table of the first out-of-range id (in the batch's key order).
        feature: the feature that id came in.
        row_id: the id.
        num_rows: the table's rows: ids must lie in ``[0, num_rows)``.
        counts: out-of-range ids in the batch, per table.
    """

    def __init__(
        self, table: str, feature: str, row_id: int, num_rows: int, counts: Mapping[str, int]
    ) -> None:
        self.table, self.feature, self.row_id, self.num_rows = table, feature, row_id, num_rows
        self.counts = dict(counts)
        total = sum(self.counts.values())
        where = ", ".join(f"{t} {n}" for t, n in sorted(self.counts.items()))
        super().__init__(
            f"table {table!r}: row id {row_id} (feature {feature!r}) out of range "
            f"[0, {num_rows}); the batch was refused before any lookup, nothing was written "
            f"({total} out-of-range id(s) in it: {where}; bounds check 'warn' would look up "
            "row 0 instead, as TorchRec does)"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # picklable, e.g. to tell the other ranks
        return (
            type(self),
            (self.table, self.feature, self.row_id, self.num_rows, self.counts),
        )


class IdBoundsCheck:
    """One module's bounds check: ``mode`` (:class:`BoundsCheck`) over the tables
    ``configs()`` lists (called at the first batch, once the module holds its configs).

    Args:
        configs: the module's table configs (every table, on any kernel).
        mode: ``ERROR`` refuses a batch with an id outside its table; ``WARN`` looks up row 0
            for it instead and logs.
    """

    def __init__(
        self, configs: Callable[[], Sequence[BaseEmbeddingConfig]], mode: BoundsCheck
    ) -> None:
        self._configs = configs
        self.mode = mode
        self._bounds: dict[tuple[tuple[str, ...], torch.device], Any] = {}
        self._out_of_range: Counter[str] = Counter()
        self._out_of_range_batches: Counter[str] = Counter()
        # id(batch) -> a batch a host check vouched for (see vouch()).
        self._vouched: dict[int, weakref.ref[KeyedJaggedTensor]] = {}
        #: Batches let in on a host check's word (:meth:`vouch`), and batches checked here.
        self.vouched_batches = 0
        self.checked_batches = 0

    def passes(self, features: KeyedJaggedTensor) -> bool:
        """Whether every id of ``features`` lies in its table (keys no table reads aside),
        with nothing raised, counted or logged: the host half of :class:`HostBoundsCheck`."""
        values = features.values()
        return not values.numel() or not self._bad_keys(features)

    def vouch(self, features: KeyedJaggedTensor) -> None:
        """Lets ``features`` in unchecked the next time it enters the module: its ids were
        found in range (:meth:`passes`) in the host batch it was copied from. Keyed by the
        batch object itself, held weakly: any batch built from it on the way to the module
        (other keys, lengths or values) is checked as usual, and a batch never run is
        forgotten."""
        key = id(features)
        vouched = self._vouched
        vouched[key] = weakref.ref(features, lambda _: vouched.pop(key, None))

    def _take_vouched(self, features: KeyedJaggedTensor) -> bool:
        ref = self._vouched.pop(id(features), None)
        return ref is not None and ref() is features

    def apply(self, features: Any) -> Any:
        """Applies the check to a batch entering the module, for every table
        (TorchRec's kernels and tiered ones): the batch itself when all its ids lie in their
        tables; with ``WARN`` a copy whose out-of-range ids are row 0.

        Runs before the input distribution, where ids are still global whatever the sharding
        (table-, row- or column-wise), so a refused batch reaches no kernel: no table plans,
        loads, trains or writes anything. The check is one min/max per feature (on a device,
        one host sync per batch, unless a host check vouched for the batch: :meth:`vouch`);
        the details are worked out only for a batch that fails it.

        Raises:
            OutOfRangeIdError: with ``ERROR``, naming the table, the feature, the id and the
                valid range of the first out-of-range id (in the batch's key order).
        """
        if not isinstance(features, KeyedJaggedTensor):
            return features
        if self._take_vouched(features):
            self.vouched_batches += 1
            return features
        values = features.values()
        if not values.numel():
            return features
        self.checked_batches += 1
        bad_keys = self._bad_keys(features)
        if not bad_keys:
            return features
        keys = features.keys()
        rows, names = self._row_bounds(keys, values.device)
        # (table, rows) of each bad key (every bad key has a table: see _bad_keys)
        tables = {k: name for k in bad_keys if (name := names[k]) is not None}
        lengths = features.length_per_key()
        offsets = features.offset_per_key()
        masks: dict[int, torch.Tensor] = {}
        for k in bad_keys:
            ids = values[offsets[k] : offsets[k + 1]]
            masks[k] = (ids < 0) | (ids >= rows[k])
        counts: Counter[str] = Counter()
        for k, mask in masks.items():
            counts[tables[k][0]] += int(mask.sum())
        first = bad_keys[0]
        table, num_rows = tables[first]
        row_id = int(values[offsets[first] : offsets[first + 1]][masks[first]][0])
        feature = keys[first]
        if self.mode is BoundsCheck.ERROR:
            raise OutOfRangeIdError(table, feature, row_id, num_rows, dict(counts))
        self._warn_out_of_range(table, feature, row_id, num_rows, counts)
        fixed = values.clone()
        for k, mask in masks.items():
            fixed[offsets[k] : offsets[k + 1]].masked_fill_(mask, 0)
        vbe = features.variable_stride_per_key()
        return KeyedJaggedTensor(
            keys=keys,
            values=fixed,
            weights=features.weights_or_none(),
            lengths=features.lengths_or_none(),
            offsets=features.offsets_or_none(),
            stride=None if vbe else features.stride(),
            stride_per_key_per_rank=features.stride_per_key_per_rank() if vbe else None,
            length_per_key=lengths,
            offset_per_key=offsets,
            inverse_indices=features.inverse_indices_or_none(),
        )

    def _bad_keys(self, features: KeyedJaggedTensor) -> list[int]:
        """The positions of the keys (with ids) holding an id outside their table, in key
        order; keys no table reads are left out."""
        values, keys = features.values(), features.keys()
        rows, names = self._row_bounds(keys, values.device)
        lengths = features.length_per_key()
        ids_of_keys = values[: sum(lengths)]
        if min(lengths) == max(lengths):  # e.g. one id per sample and feature: one reduction
            lo, hi = torch.aminmax(ids_of_keys.reshape(len(keys), -1), dim=1)
        else:
            present = [i for i, n in enumerate(lengths) if n]
            parts = ids_of_keys.split(lengths)
            low_high = [torch.aminmax(parts[i]) for i in present]
            index = torch.tensor(present, device=values.device)
            lo = torch.zeros(len(keys), dtype=values.dtype, device=values.device)
            hi = torch.zeros_like(lo)
            lo[index] = torch.stack([m for m, _ in low_high])
            hi[index] = torch.stack([m for _, m in low_high])
        bad_keys = ((lo < 0) | (hi >= rows)).nonzero().flatten().tolist()  # on a device: a sync
        return [k for k in bad_keys if names[k] is not None]

    def _row_bounds(
        self, keys: list[str], device: torch.device
    ) -> tuple[torch.Tensor, list[tuple[str, int] | None]]:
        """Per key of a batch, the row count its ids must stay below (int64's maximum for a
        key no table reads) and ``(table, rows)`` (None for such a key); cached per key order
        and device."""
        cache = self._bounds
        cache_key = (tuple(keys), device)
        if cache_key not in cache:
            by_feature: dict[str, tuple[str, int]] = {}
            for config in self._configs():
                for feature in config.feature_names:
                    known = by_feature.get(feature)
                    if known is None or config.num_embeddings < known[1]:
                        by_feature[feature] = (config.name, config.num_embeddings)
            names = [by_feature.get(key) for key in keys]
            unread = torch.iinfo(torch.int64).max
            rows = torch.tensor(
                [unread if n is None else n[1] for n in names], dtype=torch.int64, device=device
            )
            cache[cache_key] = (rows, names)
        rows, names = cache[cache_key]
        return rows, names

    def _warn_out_of_range(
        self, table: str, feature: str, row_id: int, num_rows: int, counts: Mapping[str, int]
    ) -> None:
        """Logs a ``WARN`` batch's out-of-range ids: the first batch of each table that holds
        some, then its 10th, 100th, ... (a dataset sized for other tables would log every
        step). :meth:`out_of_range_ids` counts them all."""
        totals, batches = self._out_of_range, self._out_of_range_batches
        totals.update(counts)
        batches.update(counts.keys())
        logged = [t for t in counts if batches[t] == 10 ** (len(str(batches[t])) - 1)]
        if not logged:
            return
        logger.warning(
            "table %r: row id %d (feature %r) out of range [0, %d); replaced by row 0 "
            "(bounds check 'warn', as TorchRec's fbgemm WARNING mode does). Ids replaced so "
            "far: %s",
            table,
            row_id,
            feature,
            num_rows,
            ", ".join(f"{t} {totals[t]} in {batches[t]} batch(es)" for t in sorted(logged)),
        )

    def out_of_range_ids(self) -> dict[str, int]:
        """Out-of-range ids replaced by row 0 so far (``WARN`` only), per table."""
        return dict(self._out_of_range)


class HostBoundsCheck:
    """The bounds checks of a model's tiered sharded modules, run on a batch while it is still
    on the host, so that on an accelerator no module waits for the device to learn whether
    a batch's ids lie in their tables.

    :meth:`check` the host batch, copy it to the device, :meth:`vouch` for the copy (or do both
    with :meth:`to_device`). Each module then lets in the copy's sparse features unchecked
    (:meth:`IdBoundsCheck.vouch`). A batch with an id outside its table is not vouched for:
    its module checks it on the device as before, raising or replacing ids in the same place,
    so results never depend on whether a batch went through here. On the CPU it costs what the
    module's own check would.

    Args:
        model: the sharded model (e.g. ``DistributedModelParallel``); its modules that offer
            ``id_bounds_check()`` (the tiered sharded EBC and EC) are found once, here.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._checks: list[IdBoundsCheck] = []
        for module in model.modules():
            method = getattr(module, "id_bounds_check", None)
            if callable(method):
                self._checks.append(method())

    def check(self, batch: Any) -> list[tuple[IdBoundsCheck, int]]:
        """Checks every sparse feature batch (``KeyedJaggedTensor``) on the host in ``batch``
        (itself, or in its dataclass fields, mapping values or sequence items) against every
        module; returns which pass, as ``(module check, position)``, for :meth:`vouch`."""
        if not self._checks:
            return []
        return [
            (check, i)
            for i, features in enumerate(_sparse_features(batch))
            # Features already on a device are left to their module: checking them here
            # would wait for the device just the same.
            if features.values().device.type == "cpu"
            for check in self._checks
            if check.passes(features)
        ]

    def vouch(self, passed: Sequence[tuple[IdBoundsCheck, int]], copy: Any) -> None:
        """Vouches for ``copy``, the device copy of a batch :meth:`check` returned ``passed``
        for (its sparse features are found in the same order)."""
        if not passed:
            return
        features = list(_sparse_features(copy))
        for check, i in passed:
            check.vouch(features[i])

    def to_device(self, batch: B, device: torch.device, non_blocking: bool = True) -> B:
        """``batch.to(device)``, checked here on the host first."""
        passed = self.check(batch)
        copy: B = batch.to(device, non_blocking=non_blocking)
        self.vouch(passed, copy)
        return copy


def _sparse_features(batch: Any) -> Iterator[KeyedJaggedTensor]:
    """The ``KeyedJaggedTensor`` s in ``batch``, depth first in a fixed order, so a batch and
    its device copy list theirs alike."""
    if isinstance(batch, KeyedJaggedTensor):
        yield batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from _sparse_features(getattr(batch, field.name))
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _sparse_features(value)
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _sparse_features(item)
