"""Checkpoints of virtual tables with ``torch.distributed.checkpoint``: full ones, and
incremental ones that hold only what changed since the link before.

A virtual table's state-dict entries are its live rows with their ids (see
:mod:`.virtual_state`), a number that changes between a save and a load, so dcp cannot load
them into the tensors a model hands out: :func:`expand_for_load` replaces them by tensors of
the saved sizes, of which each rank reads the rows of its own ids (or, without the model,
every row) and ``load_state_dict`` keeps those of its shards.

An incremental link (a state dict taken within :func:`saving_changes`) holds of each virtual
table, per shard:

* the live rows that changed since the link before (trained, made, looked up or loaded: their
  values or eviction statistics moved), with their ids, optimizer state beside them;
* ``evicted_id``: the ids evicted since then that are not live now (deletions);
* ``since_parent``: the eviction rounds and batches since then, by which every other row's
  statistics aged (each round multiplies a live id's count by the decay rate; each batch adds
  one to its batches since last use), and the shard's live rows, a check;
* ``bucket``: live ids per bucket, as a full state dict holds it.

:func:`merge_increment` applies one to the state the links before it built, giving exactly the
state dict a full link would have held: the changed rows replace theirs, evicted ids go, and
the other rows age as the shard that saved them aged them (the decay multiplied once per
round, as training did, so counts match bit for bit). :class:`ChainLoad` loads a chain so,
each rank reading only the rows of its own ids (a link's rows are stored in id order).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from torchrec_mtrains._compat.torch_internals import ShardedTensor
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup, tiered_groups
from torchrec_mtrains.distributed.virtual_eviction import EvictionRule
from torchrec_mtrains.distributed.virtual_state import (
    BUCKET_KEY,
    EVICTED_KEY,
    ID_KEY,
    METADATA_KEY,
    SAVING_CHANGES,
    SINCE_COLUMNS,
    SINCE_KEY,
    gather_incoming,
    row_blocks,
)

NOT_ROWS = (BUCKET_KEY, EVICTED_KEY, SINCE_KEY)
"""Entries of a virtual table that are not one row per live id."""

_DECAY_CHUNK = 1 << 16
"""Counts decayed per pass over the rounds: a chunk stays in the CPU's cache."""


@contextlib.contextmanager
def saving_changes(groups: Sequence[TieredTableGroup]) -> Iterator[int]:
    """Within it, the state dicts of the virtual tables of ``groups`` (whose changes are
    tracked: ``track_changes``) are an incremental link's (see the module docstring); it
    gives the rows they hold on this rank. Every rank enters it together, as it takes state
    dicts together."""
    shards = []
    for group in groups:
        group.drain()  # no batch is planned meanwhile: the rows and the changes agree
        for index, shard in enumerate(group.shards):
            virtual = shard.virtual
            if virtual is None:
                continue
            if virtual.changes is None:
                raise RuntimeError(
                    f"virtual table {shard.name!r}: its changes are not tracked "
                    "(track_changes) so an incremental checkpoint cannot hold it"
                )
            virtual.saving = virtual.changed_live_rows(group.changed_rows(index))
            shards.append(virtual)
    token = SAVING_CHANGES.set(True)
    try:
        yield sum(len(v.saving) for v in shards if v.saving is not None)
    finally:
        SAVING_CHANGES.reset(token)
        for virtual in shards:
            virtual.saving = None


@dataclass(frozen=True)
class VirtualEntries:
    """One virtual table's entries in one dict of a nested state dict: the model's
    (``<prefix>.<table>.weight``, ``.weight_id``, ...) or its optimizer state's
    (``<table>.<state>``, ``<table>.weight_id``).

    Attributes:
        node: the dict holding them.
        path: its keys from the top of the state dict, dot-joined as dcp flattens them.
        prefix: the entries' keys less their last part (``<prefix>.weight_id``).
    """

    node: dict[str, Any]
    path: str
    prefix: str

    @property
    def table(self) -> str:
        return self.prefix.rsplit(".", 1)[-1]

    def entry_keys(self) -> list[str]:
        return [k for k in self.node if k.startswith(f"{self.prefix}.")]

    def saved_keys(self, metadata: Any) -> dict[str, Any]:
        """The entries of this table a checkpoint's dcp ``metadata`` holds, by key here."""
        head = f"{self.path}.{self.prefix}." if self.path else f"{self.prefix}."
        return {
            f"{self.prefix}.{fqn[len(head) :]}": entry
            for fqn, entry in metadata.state_dict_metadata.items()
            if fqn.startswith(head) and "." not in fqn[len(head) :]
        }


def virtual_entries(state: Mapping[str, Any], path: str = "") -> list[VirtualEntries]:
    """Every virtual table's entries in ``state`` (nested dicts), found by their ids."""
    out: list[VirtualEntries] = []
    for key, value in state.items():
        if isinstance(value, dict):
            out.extend(virtual_entries(value, f"{path}.{key}" if path else str(key)))
        elif str(key).endswith(f".{ID_KEY}"):
            out.append(VirtualEntries(state, path, str(key)[: -len(ID_KEY) - 1]))  # type: ignore[arg-type]
    return out


def expand_for_load(
    state: dict[str, Any],
    metadata: Any,
    checkpoint_id: str | os.PathLike[str] | None = None,
    model: nn.Module | None = None,
) -> int:
    """Readies ``state`` (a state dict about to be loaded by ``torch.distributed.checkpoint``,
    nested as it was saved) for a checkpoint whose ``metadata`` (``Metadata``, from
    ``FileSystemReader(path).read_metadata()``) holds virtual tables: each of their entries
    becomes a tensor of its saved size (added where the checkpoint holds one the state lacks,
    dropped where it holds none), so that ``load_state_dict`` keeps the rows of each rank's
    shards, whatever world size saved them. Returns how many entries it replaced or added.

    Given the checkpoint's ``checkpoint_id`` and the ``model`` (whose shards say which ids each
    rank holds), each rank of a world larger than one reads only the rows of its own ids (it
    first reads the saved ids, stored in id order); otherwise every rank reads every saved row.

    Example::

        state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
        expand_for_load(state, FileSystemReader(path).read_metadata(), path, model)
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        model.fused_optimizer.load_state_dict(state["optim"])
    """
    replaced = 0
    entries_of = virtual_entries(state)
    for entries in entries_of:
        saved = entries.saved_keys(metadata)
        for key in entries.entry_keys():
            if key not in saved:
                del entries.node[key]
        for key, entry in saved.items():
            size = getattr(entry, "size", None)
            if size is None:
                continue
            entries.node[key] = torch.empty(tuple(size), dtype=entry.properties.dtype)
            replaced += 1
    world = dist.get_world_size() if dist.is_initialized() else 1
    if checkpoint_id is not None and model is not None and world > 1:
        spans = virtual_spans(tiered_groups(model))
        for entries in entries_of:
            span = spans.get(entries.table, (0, 0))
            _read_own_rows(entries, span, str(checkpoint_id), metadata)
    return replaced


def virtual_spans(groups: Iterable[TieredTableGroup]) -> dict[str, tuple[int, int]]:
    """``(first id, ids)`` of this rank's shard of each virtual table in ``groups``, by table:
    the ids whose rows a load on this rank reads."""
    return {
        s.virtual.name: (s.virtual.space.id_offset, s.virtual.space.ids)
        for g in groups
        for s in g.shards
        if s.virtual is not None
    }


def _read_own_rows(
    entries: VirtualEntries, span: tuple[int, int], checkpoint: str, metadata: Any
) -> None:
    """Makes a table's row entries (sized by :func:`expand_for_load`) read only the rows of
    the ids ``span`` (``(first id, ids)``) holds, found by the checkpoint's ids, which are
    stored in id order (a checkpoint whose ids are not is read whole)."""
    saved = entries.saved_keys(metadata)
    id_key = f"{entries.prefix}.{ID_KEY}"
    if id_key not in saved:
        return
    rows = int(saved[id_key].size[0])
    if rows == 0:
        return
    if span[1] == 0:  # a table this rank holds no shard of: none of its rows
        lo = hi = 0
    else:
        fqn = f"{entries.path}.{id_key}" if entries.path else id_key
        ids = torch.empty(rows, 1, dtype=torch.int64)
        dcp_load({fqn: ids}, checkpoint_id=checkpoint, no_dist=True)  # this rank alone
        flat = ids.reshape(-1)
        if rows > 1 and not bool((flat[1:] > flat[:-1]).all()):
            return  # not in id order (not written here): every row is read
        lo = int(torch.searchsorted(flat, span[0]))
        hi = int(torch.searchsorted(flat, span[0] + span[1]))
    for key, entry in saved.items():
        if key[len(entries.prefix) + 1 :] in NOT_ROWS or int(entry.size[0]) != rows:
            continue
        entries.node[key] = _row_block(tuple(entry.size), entry.properties.dtype, lo, hi)


class IncrementError(ValueError):
    """An incremental link that does not apply to the state the links before it built."""


def _rows(entries: VirtualEntries) -> dict[str, torch.Tensor]:
    """The table's entries as whole tensors, by the last part of their keys."""
    out = {}
    for key in entries.entry_keys():
        value = entries.node[key]
        out[key[len(entries.prefix) + 1 :]] = (
            gather_incoming(value) if isinstance(value, ShardedTensor) else value
        )
    return out


def merge_increment(
    base: VirtualEntries,
    increment: Mapping[str, torch.Tensor],
    rule: EvictionRule | None,
    span: tuple[int, int] | None = None,
) -> None:
    """Applies one incremental link's entries of a table (``increment``, by the last part of
    their keys, each whole) to ``base`` (the same table's entries in the state the links
    before built, whole tensors), in place: see the module docstring. ``rule`` is the table's
    eviction rule, which says how its statistics age (``None``: this rank holds no shard of
    the table, and ages nothing). ``span``: ``(first id, ids)`` when both hold only the rows
    of those ids (see :class:`ChainLoad`), else ``None``.

    Raises:
        IncrementError: the result's live rows differ from those the link records.
    """
    old = _rows(base)
    old_ids = old[ID_KEY].reshape(-1)
    new_ids = increment[ID_KEY].reshape(-1).to(torch.int64)
    evicted = increment.get(EVICTED_KEY, torch.empty(0, 1, dtype=torch.int64)).reshape(-1)
    keep = ~torch.from_numpy(np.isin(old_ids.numpy(), torch.cat([evicted, new_ids]).numpy()))
    since = increment.get(SINCE_KEY)
    merged: dict[str, torch.Tensor] = {}
    for name, value in old.items():
        if name in NOT_ROWS:
            continue
        if name not in increment:
            raise IncrementError(f"virtual table {base.table!r}: the link holds no {name!r}")
        kept = value[keep]
        if name == METADATA_KEY and since is not None and rule is not None:
            kept = _aged(kept, old_ids[keep], since, rule)
        merged[name] = torch.cat([kept, increment[name].to(value.dtype)])
    ids = merged[ID_KEY].reshape(-1)
    order = torch.argsort(ids, stable=True)
    for name, value in merged.items():
        base.node[f"{base.prefix}.{name}"] = value[order]
    if BUCKET_KEY in increment:
        base.node[f"{base.prefix}.{BUCKET_KEY}"] = increment[BUCKET_KEY]
    if since is not None:
        _check_live(base.table, ids, since, span)


def _aged(
    metadata: torch.Tensor, ids: torch.Tensor, since: torch.Tensor, rule: EvictionRule
) -> torch.Tensor:
    """``metadata`` (rows of ``ids`` the link does not hold) aged as each row's shard aged
    it: counts decayed once per round, batches since last use moved on."""
    out = metadata.clone()
    columns = rule.columns
    first, count, rounds, batches = (SINCE_COLUMNS.index(c) for c in SINCE_COLUMNS[:4])
    for shard in since.tolist():
        mine = (ids >= shard[first]) & (ids < shard[first] + shard[count])
        if not bool(mine.any()):
            continue
        block = out[mine].numpy()
        if "count" in columns and shard[rounds]:
            counts = np.ascontiguousarray(block[:, columns.index("count")])
            for start in range(0, len(counts), _DECAY_CHUNK):
                part = counts[start : start + _DECAY_CHUNK]
                for _ in range(shard[rounds]):
                    part *= rule.decay_rate  # as each round did: bit for bit
            block[:, columns.index("count")] = counts
        if "batches_ago" in columns:
            block[:, columns.index("batches_ago")] += float(shard[batches])
        out[mine] = torch.from_numpy(block)
    return out


def _check_live(
    table: str, ids: torch.Tensor, since: torch.Tensor, span: tuple[int, int] | None
) -> None:
    """Each saved shard's live rows against the merged ids: those whose ids lie within
    ``span`` (``(first id, ids)``: the rows this rank read), or all of them."""
    first, count, live = (SINCE_COLUMNS.index(c) for c in ("first_id", "ids", "live_rows"))
    for shard in since.tolist():
        start, end = shard[first], shard[first] + shard[count]
        if span is not None and not (span[0] <= start and end <= span[0] + span[1]):
            continue  # partly or wholly another rank's rows: not read here
        held = int(((ids >= shard[first]) & (ids < shard[first] + shard[count])).sum())
        if held != shard[live]:
            raise IncrementError(
                f"virtual table {table!r}: ids [{shard[first]}, {shard[first] + shard[count]}) "
                f"hold {held} live rows after the link, which records {shard[live]}: the link "
                "does not build on the state loaded before it"
            )


class ChainLoad:
    """Loads the virtual tables of a chain's links into one state dict, link by link: the
    full link's entries as they are, each incremental one's merged into them
    (:func:`merge_increment`), so that the state ends up as the last link's full state.

    Args:
        state: the state dict the links are loaded into (as built for saving).
        rules: each virtual table's eviction rule, by table (those of this rank's shards).
        spans: ``(first id, ids)`` of this rank's shard of each virtual table, by table:
            with more than one rank, each rank then reads of a link only the rows of those
            ids (none of a table it holds no shard of), found by the link's ids, which are
            stored in id order; ``None``: every rank reads every row.

    Example::

        chain_load = ChainLoad(state, rules, spans)
        for i, link in enumerate(links):
            chain_load.before(link.path, incremental=i > 0)
            dcp.load(state, checkpoint_id=link.path)
            chain_load.after()
    """

    def __init__(
        self,
        state: dict[str, Any],
        rules: Mapping[str, EvictionRule],
        spans: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        self.state = state
        self.rules = dict(rules)
        self.entries = virtual_entries(state)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.spans = dict(spans) if spans is not None and world > 1 else None
        self._before: list[dict[str, Any]] = []

    def before(self, checkpoint: str | os.PathLike[str], incremental: bool) -> None:
        """Readies the state for ``checkpoint``'s virtual entries (see :func:`expand_for_load`),
        keeping what the links before it loaded when it is ``incremental``."""
        if not self.entries:
            return
        self._before = (
            [{k: e.node[k] for k in e.entry_keys()} for e in self.entries] if incremental else []
        )
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
        expand_for_load(self.state, metadata)
        if self.spans is not None:
            for entries in self.entries:
                span = self.span(entries.table)
                assert span is not None
                _read_own_rows(entries, span, str(checkpoint), metadata)

    def span(self, table: str) -> tuple[int, int] | None:
        """The ids whose rows this rank reads of ``table`` (``None``: all of them)."""
        if self.spans is None:
            return None
        return self.spans.get(table, (0, 0))

    def after(self) -> None:
        """Merges the link just loaded into what the links before it loaded.

        Raises:
            IncrementError: it does not apply to that state (see :func:`merge_increment`).
        """
        for entries, rows in zip(self.entries, self._before):
            increment = _rows(entries)
            for key in entries.entry_keys():
                del entries.node[key]
            entries.node.update(rows)
            merge_increment(
                entries, increment, self.rules.get(entries.table), self.span(entries.table)
            )
        self._before = []


def _row_block(size: tuple[int, ...], dtype: torch.dtype, lo: int, hi: int) -> ShardedTensor:
    """A ShardedTensor of ``size`` whose only local shard is rows ``[lo, hi)`` (none when
    empty); the other rows are given to another rank, so that dcp reads this rank's alone."""
    rank = dist.get_rank()
    other = (rank + 1) % dist.get_world_size()
    blocks = [(lo, other), (hi - lo, rank), (size[0] - hi, other)]
    local = torch.empty(hi - lo, *size[1:], dtype=dtype)
    return row_blocks([b for b in blocks if b[0] > 0], local, rank, None)
