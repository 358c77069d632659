"""ShardedTensors whose local shards view a tier's rows in place.

A tier stores each row's weights followed by its optimizer state, so the weights of a shard are a
strided (non-contiguous) view of the tier's rows, and so is each optimizer state. ShardedTensor
only accepts contiguous local shards at construction; these helpers construct with a contiguous
alias of the same storage (same shape, dtype, device, no copy) and then put the real strided view
in its place, as TorchRec itself does for key-value tables. Checkpoint writers copy one shard at
a time (cloning views), so splitting shards into row chunks bounds the memory a save needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchrec_mtrains._compat.torch_internals import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    init_from_local_shards,
    remote_device,
)

TIER_DEVICE = "cpu"
"""Where tier-backed tensors live, whatever device computes: a tier's rows (and the views that
checkpoints and optimizer state expose of them) are host memory or files, never HBM. Their
ShardedTensor metadata must say so, or ShardedTensor refuses the shards when the plan's device
is ``cuda``; it also makes a checkpoint of a tiered table independent of the compute device."""


def on_host(md: ShardMetadata) -> ShardMetadata:
    """``md`` with its placement moved to :data:`TIER_DEVICE` on the same rank."""
    placement = md.placement
    rank = placement.rank() if placement is not None else None
    if rank is None:
        raise ValueError(f"shard at {md.shard_offsets} has no rank in its placement {placement}")
    return ShardMetadata(
        shard_offsets=list(md.shard_offsets),
        shard_sizes=list(md.shard_sizes),
        placement=remote_device(f"rank:{rank}/{TIER_DEVICE}"),
    )


def all_on_host(md: ShardedTensorMetadata) -> ShardedTensorMetadata:
    """``md`` with every shard (this rank's and the others') placed on :data:`TIER_DEVICE`."""
    return ShardedTensorMetadata(
        shards_metadata=[on_host(s) for s in md.shards_metadata],
        size=md.size,
        tensor_properties=md.tensor_properties,
    )


def contiguous_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``tensor``'s shape starting at the same storage element.

    Its values are meaningless; it only satisfies ShardedTensor's construction checks."""
    if tensor.is_contiguous():
        return tensor
    strides, acc = [], 1
    for size in reversed(tensor.shape):
        strides.append(acc)
        acc *= size
    return tensor.as_strided(tensor.shape, tuple(reversed(strides)), tensor.storage_offset())


def _key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype


def init_sharded_tensor(
    local_shards: list[Shard], metadata: ShardedTensorMetadata, pg: dist.ProcessGroup | None
) -> ShardedTensor:
    """A ``ShardedTensor`` of ``local_shards`` under the global ``metadata``, built on this rank
    alone (see :func:`~torchrec_mtrains._compat.torch_internals.init_from_local_shards`), that
    accepts strided views."""
    aliases = [Shard(contiguous_alias(s.tensor), s.metadata) for s in local_shards]
    st = init_from_local_shards(aliases, metadata, pg)
    for mine, real in zip(st.local_shards(), local_shards):
        mine.tensor = real.tensor
    return st


def swap_aliases(
    tensor: ShardedTensor,
    real_by_alias: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor],
) -> None:
    """Replaces local shards that are aliases (see :func:`contiguous_alias`) by their views."""
    for shard in tensor.local_shards():
        real = real_by_alias.get(_key(shard.tensor))
        if real is not None:
            shard.tensor = real


def alias_registry(
    views: list[torch.Tensor],
) -> tuple[list[torch.Tensor], dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor]]:
    """Returns contiguous aliases of ``views`` and the map from each alias back to its view."""
    aliases = [contiguous_alias(v) for v in views]
    return aliases, {_key(a): v for a, v in zip(aliases, views)}


def chunk_sharded_tensor(
    tensor: ShardedTensor, chunk_rows: int, pg: dist.ProcessGroup | None
) -> ShardedTensor:
    """Re-expresses ``tensor`` with every shard (on every rank) split into row chunks of at most
    ``chunk_rows`` rows; local chunks are views of the original local shards.

    The split is computed from global metadata alone, so all ranks agree on it."""
    md = tensor.metadata()
    new_global: list[ShardMetadata] = []
    for shard_md in md.shards_metadata:
        new_global.extend(split_shard_metadata(shard_md, chunk_rows))
    local: list[Shard] = []
    for shard in tensor.local_shards():
        for sub_md in split_shard_metadata(shard.metadata, chunk_rows):
            start = sub_md.shard_offsets[0] - shard.metadata.shard_offsets[0]
            local.append(Shard(shard.tensor.narrow(0, start, sub_md.shard_sizes[0]), sub_md))
    global_md = ShardedTensorMetadata(
        shards_metadata=new_global, size=md.size, tensor_properties=md.tensor_properties
    )
    return init_sharded_tensor(local, global_md, pg)


def split_shard_metadata(md: ShardMetadata, chunk_rows: int) -> list[ShardMetadata]:
    """Splits one shard's metadata into consecutive row ranges of at most ``chunk_rows``."""
    rows = md.shard_sizes[0]
    if rows <= chunk_rows:
        return [md]
    out = []
    for start in range(0, rows, chunk_rows):
        sizes = list(md.shard_sizes)
        sizes[0] = min(chunk_rows, rows - start)
        offsets = list(md.shard_offsets)
        offsets[0] += start
        out.append(ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=md.placement))
    return out
