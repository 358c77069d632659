"""torch's internals the library relies on: ``ShardedTensor`` and its metadata (public classes in
private modules, TorchRec's state dicts are made of them), process-group internals, tensor
version counters and the order of load-state-dict pre-hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard
from torch.distributed.checkpoint import _nested_dict
from torch.distributed.distributed_c10d import Store
from torch.distributed.remote_device import _remote_device
from torch.utils.hooks import RemovableHandle

from torchrec_mtrains._compat.registry import Use, declare, private_attr, reaches

__all__ = [
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "TensorProperties",
    "abort_process_group",
    "default_store",
    "flatten_state_dict",
    "init_from_local_shards",
    "prepend_load_state_dict_pre_hook",
    "remote_device",
    "tensor_version",
]

_SHARD = "torch.distributed._shard"

SHARDED_TENSOR = declare(
    (
        f"{_SHARD}.sharded_tensor.api:ShardedTensor",
        f"{_SHARD}.sharded_tensor.shard:Shard",
        f"{_SHARD}.sharded_tensor.metadata:ShardedTensorMetadata",
        f"{_SHARD}.sharded_tensor.metadata:TensorProperties",
        f"{_SHARD}.metadata:ShardMetadata",
    ),
    "_shard",
    Use.IMPORTED,
    reaches="the module path of ShardedTensor, Shard and their metadata, the tensors TorchRec's "
    "sharded modules and fused optimizers put in state dicts (torch has no public path).",
    breaks="no state dict, checkpoint or initializer of a sharded table can be read or built.",
)

INIT_SHARDED_TENSOR = declare(
    f"{_SHARD}.sharded_tensor.api:ShardedTensor",
    "_init_from_local_shards_and_global_metadata",
    Use.CALLED,
    parameters=(
        "local_shards",
        "sharded_tensor_metadata",
        "process_group",
        "init_rrefs",
        "sharding_spec",
    ),
    reaches="builds a ShardedTensor from this rank's shards and the global metadata without a "
    "collective (TorchRec builds its own state this way).",
    breaks="tier-backed tables and optimizer states cannot appear in state dicts, and row "
    "chunks of resident tables cannot be made.",
)

REMOTE_DEVICE = declare(
    "torch.distributed.remote_device",
    "_remote_device",
    Use.CALLED,
    parameters=("remote_device",),
    reaches="the placement class of ShardMetadata (``rank:0/cpu``).",
    breaks="tier-backed shards cannot be placed on the host when the plan's device is cuda.",
)

FLATTEN_STATE_DICT = declare(
    "torch.distributed.checkpoint._nested_dict",
    "flatten_state_dict",
    Use.CALLED,
    parameters=("state_dict",),
    reaches="dcp's flattening of a nested state dict into its entry keys.",
    breaks="a tiered checkpoint's entries cannot be matched to the keys dcp saved them under.",
)

DEFAULT_STORE = declare(
    "torch.distributed.distributed_c10d",
    "_get_default_store",
    Use.CALLED,
    parameters=(),
    reaches="the default process group's key-value store.",
    breaks="a rank cannot tell the others that it failed, so they wait out the collective "
    "timeout instead of stopping with its error.",
)

ABORT_PROCESS_GROUP = declare(
    "torch.distributed.distributed_c10d",
    "_abort_process_group",
    Use.CALLED,
    parameters=("group",),
    reaches="ends a process group at once, failing the other ranks' pending collectives.",
    breaks="nothing fails: the group is destroyed instead, and the other ranks notice later.",
)

TENSOR_VERSION = declare(
    "torch:Tensor",
    "_version",
    Use.READ,
    reaches="the autograd version counter, bumped by every in-place write to a tensor or a "
    "view of its storage.",
    breaks="writes users make through the tensors state dicts and optimizers hand out are "
    "not seen, so they never reach the tiers.",
)

LOAD_STATE_DICT_PRE_HOOKS = declare(
    "torch.nn:Module",
    "_load_state_dict_pre_hooks",
    Use.READ,
    reaches="the ordered dict of a module's load_state_dict pre-hooks, by handle id.",
    breaks="a hook cannot run before TorchRec's own, which would concatenate a chunked "
    "table's state into one copy as large as the table.",
)


@reaches(INIT_SHARDED_TENSOR)
def init_from_local_shards(
    local_shards: list[Shard], metadata: ShardedTensorMetadata, pg: dist.ProcessGroup | None
) -> ShardedTensor:
    """A ``ShardedTensor`` of ``local_shards`` under the global ``metadata``, built on this
    rank alone."""
    return cast(
        ShardedTensor,
        getattr(ShardedTensor, INIT_SHARDED_TENSOR.name)(
            local_shards=local_shards, sharded_tensor_metadata=metadata, process_group=pg
        ),
    )


@reaches(REMOTE_DEVICE)
def remote_device(placement: str) -> Any:
    """The placement of a shard's metadata, e.g. ``"rank:0/cpu"``."""
    return _remote_device(placement)


@reaches(FLATTEN_STATE_DICT)
def flatten_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened as dcp flattens it, by entry key."""
    flat, _ = _nested_dict.flatten_state_dict(state)
    return flat


@reaches(DEFAULT_STORE)
def default_store() -> Store:
    """The default process group's store (the group must be initialized)."""
    return cast(Store, getattr(distributed_c10d, DEFAULT_STORE.name)())


@reaches(ABORT_PROCESS_GROUP)
def abort_process_group() -> Callable[[], None] | None:
    """What ends the default group at once, or ``None`` where this torch has no such call."""
    abort: Callable[[], None] | None = getattr(distributed_c10d, ABORT_PROCESS_GROUP.name, None)
    return abort


@reaches(TENSOR_VERSION)
def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (shared by the views of one storage)."""
    return int(tensor._version)


@reaches(LOAD_STATE_DICT_PRE_HOOKS)
def prepend_load_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> None:
    """Registers ``hook(module, state_dict, prefix, ...)`` to run before ``module``'s other
    load_state_dict pre-hooks (``register_load_state_dict_pre_hook`` appends)."""
    # torch leaves the method unannotated: typed here by what it takes and returns
    register: Callable[[Callable[..., None]], RemovableHandle] = (
        module.register_load_state_dict_pre_hook
    )
    handle = register(hook)
    hooks = private_attr(module, LOAD_STATE_DICT_PRE_HOOKS)
    hooks.move_to_end(handle.id, last=False)
