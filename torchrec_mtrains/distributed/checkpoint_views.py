"""Tensors that view a tiered kernel's rows where they live, for state dicts, checkpoints and
optimizers, and the writes users make through them.

TorchRec reads and writes a table's state through tensors (``state_dict``, the fused
optimizer's state, dcp): for a tiered table these view the tier's rows in place (its memory, or
a mapping of its file), never a copy, so a checkpoint streams a table larger than memory chunk
by chunk. The views show the tier, not the cache: sync the group before reading them
(``TieredTableGroup.sync_views``: it flushes the cache, then refreshes the copies that stand for
log-structured tiers, see :class:`TierViews`).

Users also *write* through them, as they do through the tensors TorchRec's FUSED kernel hands
out (which alias its weights): TorchRec's ``copy_state_dict``, ``dcp.load(model.state_dict())``
without a ``load_state_dict`` after, an optimizer state loaded in place. Such a write reaches a
flat tier's rows but not the cache in front of them, nor the log behind a copy. So every view
hands out tensors whose in-place writes PyTorch counts (each tensor's version counter, shared
with the views and chunks made from it): one counter for a shard's weights and one per
optimizer state, and the group takes in whatever was written (``absorb_view_writes``) before it
next reads or writes its rows. Writes that bypass the counters (through ``.data`` or a numpy
array of a view) are not seen; ``load_state_dict`` after them stores them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torchrec_mtrains._compat.torch_internals import tensor_version
from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.tiers import OpenMode
from torchrec_mtrains.tiers.byte_scm import ByteSCMStore
from torchrec_mtrains.tiers.options import ByteScmOptions

VIEW_DIR = "views"
"""Subdirectory of a tier directory holding the exported copies of log-structured tables."""

WEIGHTS = "weights"
"""The written part of a shard naming its weights (the others are its optimizer states' keys)."""


class TierViews:
    """Views of the rows of ``shards`` (one kernel's), and what was written through them.

    A tier whose file is the flat row array is viewed in place: its memory, or a mapping of
    its file. A log-structured tier's file is not, so its view is a flat copy in a file of its
    own (``<tier dir>/views/``), exported from the log by :meth:`refresh` (when something is
    about to read the views: a state dict, the optimizer's state, a checkpoint load) and only
    if the table changed since, and stored back by :meth:`store_writes` once something wrote
    it. Training never touches the copy.

    Args:
        shards: the kernel's table shards, in its table order.
        chunk_rows: rows per call when the rows written through a view are stored again.
    """

    def __init__(self, shards: Sequence[TieredTableShard], chunk_rows: int) -> None:
        self._shards = shards
        self._chunk_rows = chunk_rows
        self._rows: dict[int, np.ndarray[Any, Any]] = {}  # stored words the views show
        self._copies: dict[int, ByteSCMStore] = {}  # exported copies, by shard index
        self._exported: dict[int, int | None] = {}  # the store version each copy holds
        # Per shard, one tensor over its rows per part (weights, each optimizer state), each
        # with a version counter of its own that in-place writes through its views bump, and
        # the counts last taken in.
        self._bases: dict[int, dict[str, torch.Tensor]] = {}
        self._seen: dict[int, dict[str, int]] = {}
        self._deferred = 0

    def tier_rows(self, index: int) -> np.ndarray[Any, Any]:
        """Shard ``index``'s rows on its tier as ``(rows, row_words)`` stored words (see
        :class:`~torchrec_mtrains.types.RowLayout`), viewing the tier's memory, a mapping of
        its file, or the exported copy, without copying."""
        if index not in self._rows:
            store = self._shards[index].store
            array = store.mapped_rows()
            if array is None and store.file_layout == "flat":
                # Block tiers have no byte-addressable copy: map the file.
                store.flush()
                layout = store.layout
                array = np.memmap(
                    store.path,
                    dtype=layout.word_dtype,
                    mode="r+",
                    offset=store.data_offset,
                    shape=(layout.num_rows, layout.row_words),
                )
            elif array is None:
                array = self._export(index)
            self._rows[index] = array
        return self._rows[index]

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

    def _base(self, index: int, part: str) -> torch.Tensor:
        """The bytes of shard ``index``'s rows, ``(rows, row_bytes)``, as the tensor the views
        of ``part`` are made from (its own version counter)."""
        bases = self._bases.setdefault(index, {})
        if part not in bases:
            bases[part] = torch.from_numpy(self.tier_rows(index).view(np.uint8))
            self._seen.setdefault(index, {})[part] = tensor_version(bases[part])
        return bases[part]

    def is_copy(self, index: int) -> bool:
        """Whether shard ``index``'s view is an exported copy of its rows (a log-structured
        tier), not the rows themselves."""
        self.tier_rows(index)
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
        show the tier as of now (call it after a flush, and after taking in what was written
        through the views: an export overwrites the copy); nothing while :meth:`deferred`
        unless ``force``. Flat tiers need nothing. The copy's dirty pages are written out as
        the export goes, so it needs little memory."""
        if self._deferred and not force:
            return
        for index in self._copies:
            self._export_if_stale(index)

    def _export_if_stale(self, index: int) -> None:
        copy, store = self._copies[index], self._shards[index].store
        if self._exported[index] != store.version:
            copy.allocate()  # a full device fails here, naming the file, not as a SIGBUS
            store.export_rows(copy.mapped_rows(), written=copy.flush)
            self._exported[index] = store.version

    def weight_view(self, index: int) -> torch.Tensor:
        """Shard ``index``'s weights on its tier, ``(rows, cols)`` at the table's dtype."""
        layout = self._shards[index].store.layout
        raw = self._base(index, WEIGHTS)[:, : layout.dim * layout.dtype.itemsize]
        return raw.view(layout.dtype.torch_dtype)

    def state_views(self, index: int) -> dict[str, torch.Tensor]:
        """Optimizer states on the tier (fp32), shaped as fbgemm's ``get_optimizer_state()``
        would show them."""
        shard = self._shards[index]
        layout = shard.store.layout
        out: dict[str, torch.Tensor] = {}
        column = shard.cols
        for key, view, shape in zip(shard.state_keys, shard.state_slots, shard.state_shapes):
            width = view.shape[1]
            start = layout.byte_offset(column)
            raw = self._base(index, key)[:, start : start + width * layout.state_dtype.itemsize]
            part = raw.view(layout.state_dtype.torch_dtype)
            out[key] = part.reshape(shard.local_rows, *shape) if shape else part[:, 0]
            column += width
        return out

    def part_columns(self, index: int, part: str) -> slice:
        """The row values (``0 .. row_width``) ``part`` of shard ``index`` holds."""
        shard = self._shards[index]
        if part == WEIGHTS:
            return slice(0, shard.cols)
        column = shard.cols
        for key, view in zip(shard.state_keys, shard.state_slots):
            if key == part:
                return slice(column, column + int(view.shape[1]))
            column += int(view.shape[1])
        raise KeyError(f"table {shard.name!r} has no optimizer state {part!r}")

    # ------------------------------------------------------------------ writes through views

    def written(self, index: int) -> list[str]:
        """The parts of shard ``index`` (:data:`WEIGHTS`, optimizer state keys) written in place
        through their views since :meth:`mark_seen`."""
        seen = self._seen.get(index, {})
        return [
            part
            for part, base in self._bases.get(index, {}).items()
            if tensor_version(base) != seen[part]
        ]

    def mark_seen(self, index: int) -> None:
        """Says what was written through shard ``index``'s views so far is taken in."""
        self._seen[index] = {
            part: tensor_version(base) for part, base in self._bases.get(index, {}).items()
        }

    def mark_written(self, index: int) -> None:
        """Says a load is about to write some of shard ``index``'s rows through its view: a
        stale copy is exported first, so that :meth:`store_writes` stores the rows the load
        did not write as the tier holds them."""
        if self.is_copy(index) and not self.is_current(index):
            self._export_if_stale(index)

    def store_writes(self, index: int, parts: Sequence[str]) -> bool:
        """Makes what was written through shard ``index``'s views (``parts`` of its rows) the
        tier's: a copy is stored back through the store API, chunk by chunk (whole rows where
        the copy is current, else the written columns over the tier's rows); a tier viewed in
        place only needs to be told (the DRAM tier then writes its file at the next flush; a
        mapping of a block tier's file is written out, so the store's direct reads see it).

        While the views are :meth:`deferred` (a checkpoint's save or load), a copy older than
        its tier is not stored.

        Returns:
            Whether the copy was stale: the tier had been written since its export, and rows
            the writes left alone went back to the values they had then (in the written parts).
        """
        store = self._shards[index].store
        rows = self.tier_rows(index)
        if self._deferred and index in self._copies and not self.is_current(index):
            # A checkpoint's own loaders write a log directly, leaving its copy stale, and
            # write through a copy only once it is current (mark_written): what a stale copy
            # got meanwhile is a state dict loaded onto itself (a no-op), not new rows.
            return False
        if index not in self._copies:
            if isinstance(rows, np.memmap):
                rows.flush()
            store.mapped_rows_written()
            return False
        stale = not self.is_current(index)
        layout = store.layout
        columns = [self.part_columns(index, p) for p in parts]
        whole = not stale or sum(c.stop - c.start for c in columns) == layout.row_width
        for start in range(0, layout.num_rows, self._chunk_rows):
            words = rows[start : start + self._chunk_rows]
            if whole:
                store.write_range(start, layout.decode(words))
                continue
            merged = store.read_range(start, words.shape[0])
            given = layout.decode(words)
            for c in columns:
                merged[:, c] = given[:, c]
            store.write_range(start, merged)
        if whole:
            self._exported[index] = store.version  # the copy is what the tier now holds
        return stale

    def store_as_tier(self, index: int) -> None:
        """Stores what shard ``index``'s view holds as its rows, where the view stands for
        them: always for a tier viewed in place, for a copy only while it is current (a
        stale one holds nothing newer than its tier). For ``load_state_dict`` of the model's
        own state dict, which copies nothing: what was written through ``.data`` or numpy
        (unseen by :meth:`written`) is stored then, as TorchRec's documented in-place load
        ("load into the state dict, then load_state_dict") expects."""
        if self.is_copy(index) and not self.is_current(index):
            return
        self.store_writes(index, [WEIGHTS, *self._shards[index].state_keys])

    def close(self) -> None:
        """Drops the file mappings and the exported copies (before the stores close)."""
        self._rows.clear()
        self._bases.clear()
        for copy in self._copies.values():
            copy.path.unlink(missing_ok=True)
            copy.close()
        self._copies.clear()
