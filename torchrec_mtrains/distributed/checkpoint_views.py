"""Tensors that view a tiered kernel's rows where they live, for checkpoints and optimizers.

TorchRec reads and writes a table's state through tensors (``state_dict``, the fused
optimizer's state, dcp): for a tiered table these view the tier's rows in place (its memory, or
a mapping of its file), never a copy, so a checkpoint streams a table larger than memory chunk
by chunk. The views show the tier, not the cache: sync the group before reading them
(``TieredTableGroup.sync_views``: it flushes the cache, then refreshes the copies that stand for
log-structured tiers, see :class:`TierViews`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.tiers import OpenMode
from torchrec_mtrains.tiers.byte_scm import ByteSCMStore
from torchrec_mtrains.tiers.options import ByteScmOptions

VIEW_DIR = "views"
"""Subdirectory of a tier directory holding the exported copies of log-structured tables."""


class TierViews:
    """Views of the rows of ``shards`` (one kernel's), and writing back what was written
    through them.

    A tier whose file is the flat row array is viewed in place: its memory, or a mapping of
    its file. A log-structured tier's file is not, so its view is a flat copy in a file of its
    own (``<tier dir>/views/``), exported from the log by :meth:`refresh` (when something is
    about to read the views: a state dict, the optimizer's state, a checkpoint load) and only
    if the table changed since, and imported back by :meth:`persist_writes` after a checkpoint
    load wrote it. Training never touches the copy.

    Args:
        shards: the kernel's table shards, in its table order.
        chunk_rows: rows per call when the rows written through a view are stored again.
    """

    def __init__(self, shards: Sequence[TieredTableShard], chunk_rows: int) -> None:
        self._shards = shards
        self._chunk_rows = chunk_rows
        self._mapped: dict[int, np.ndarray[Any, Any]] = {}
        self._copies: dict[int, ByteSCMStore] = {}  # exported copies, by shard index
        self._exported: dict[int, int | None] = {}  # the store version each copy holds
        self._written: set[int] = set()  # copies a load wrote through since their export
        self._deferred = 0

    def mapped_rows(self, index: int) -> torch.Tensor:
        """Shard ``index``'s rows on its tier as a ``(rows, row_width)`` tensor viewing the file
        (or the tier's memory, or the exported copy), without copying."""
        if index not in self._mapped:
            store = self._shards[index].store
            array = store.mapped_rows()
            if array is None and store.file_layout == "flat":
                # Block tiers have no byte-addressable copy: map the file.
                store.flush()
                layout = store.layout
                array = np.memmap(
                    store.path,
                    dtype=layout.dtype.numpy_dtype,
                    mode="r+",
                    offset=store.data_offset,
                    shape=(layout.num_rows, layout.row_width),
                )
            elif array is None:
                array = self._export(index)
            self._mapped[index] = array
        return torch.from_numpy(self._mapped[index])

    def _export(self, index: int) -> np.ndarray[Any, Any]:
        store = self._shards[index].store
        directory = store.directory / VIEW_DIR
        directory.mkdir(mode=0o700, exist_ok=True)
        # Sparse until first exported: the app's checkpoints never export it, and a table's
        # worth of disk for a copy nobody fills would double a log's footprint.
        copy = ByteSCMStore(
            directory,
            f"{store.table}.{store.name}",
            store.layout,
            mode=OpenMode.TRUNCATE,
            options=ByteScmOptions(preallocate=False),
        )
        self._copies[index] = copy
        self._exported[index] = None  # filled by the first refresh()
        return copy.mapped_rows()

    def is_copy(self, index: int) -> bool:
        """Whether shard ``index``'s view is an exported copy of its rows (a log-structured
        tier), not the rows themselves."""
        self.mapped_rows(index)
        return index in self._copies

    def is_current(self, index: int) -> bool:
        """Whether shard ``index``'s view shows its tier as of now (always, unless a copy)."""
        if not self.is_copy(index):
            return True
        return self._exported[index] == self._shards[index].store.version

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within the block, :meth:`refresh` exports nothing: for a checkpoint that streams
        the copied tables from their tiers and only needs the state dict's structure."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1

    def refresh(self, force: bool = False) -> None:
        """Exports again the copies whose table was written since they were made, so the views
        show the tier as of now (call it after a flush); nothing while :meth:`deferred`
        unless ``force``. Flat tiers need nothing. The copy's dirty pages are written out as
        the export goes, so it needs little memory."""
        if self._deferred and not force:
            return
        for index, copy in self._copies.items():
            store = self._shards[index].store
            if self._exported[index] != store.version:
                copy.allocate()  # a full device fails here, naming the file, not as a SIGBUS
                store.export_rows(copy.mapped_rows(), written=copy.flush)
                self._exported[index] = store.version

    def weight_view(self, index: int) -> torch.Tensor:
        """Shard ``index``'s weights on its tier, ``(rows, cols)``."""
        return self.mapped_rows(index)[:, : self._shards[index].cols]

    def state_views(self, index: int) -> dict[str, torch.Tensor]:
        """Optimizer states on the tier, shaped as fbgemm's ``get_optimizer_state()`` would."""
        shard = self._shards[index]
        rows = self.mapped_rows(index)
        out: dict[str, torch.Tensor] = {}
        start = shard.cols
        for key, view, shape in zip(shard.state_keys, shard.state_slots, shard.state_shapes):
            width = view.shape[1]
            part = rows[:, start : start + width]
            out[key] = part.reshape(shard.local_rows, *shape) if shape else part[:, 0]
            start += width
        return out

    def mark_written(self, index: int) -> None:
        """Says a load is about to write shard ``index``'s rows through its view: a stale copy
        is exported first (a load may write only some columns), and :meth:`persist_writes`
        then stores the copy."""
        if self.is_copy(index):
            if not self.is_current(index):
                self.refresh(force=True)
            self._written.add(index)

    def persist_writes(self, index: int | None = None) -> None:
        """Stores the rows of shard ``index`` (all shards when ``None``) again through the store
        API, chunk by chunk, after a checkpoint load wrote them through the views.

        Writes through a tier's ``mapped_rows()`` bypass its bookkeeping; the dram tier, whose
        view is its in-memory copy, would never write them to its file, and a log-structured
        tier's view is a copy. (A flat block tier's view maps the file itself: nothing to do.)
        A copy is stored back only when current or written (:meth:`mark_written`): a stale one
        holds nothing the tier lacks. Nothing may write the tier between the load into the
        views and this call."""
        for i in range(len(self._shards)) if index is None else [index]:
            store = self._shards[i].store
            mapped = store.mapped_rows()
            if mapped is None and i in self._copies:
                if not self.is_current(i) and i not in self._written:
                    continue
                mapped = self._copies[i].mapped_rows()
            if mapped is None:
                continue
            for start in range(0, store.layout.num_rows, self._chunk_rows):
                store.write_range(start, mapped[start : start + self._chunk_rows])
            if i in self._copies:
                self._exported[i] = store.version  # the copy is what the tier now holds
                self._written.discard(i)

    def close(self) -> None:
        """Drops the file mappings and the exported copies (before the stores close)."""
        self._mapped.clear()
        for copy in self._copies.values():
            copy.path.unlink(missing_ok=True)
            copy.close()
        self._copies.clear()
