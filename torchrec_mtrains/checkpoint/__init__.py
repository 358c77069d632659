"""Checkpoint chains for a TorchRec training loop over ``DistributedModelParallel``, with or
without tiered tables: full and incremental links through ``torch.distributed.checkpoint``,
each incremental one naming its parent, retention, and a restore from the newest complete link
at any world size (:class:`CheckpointManager`). :class:`CheckpointDirectory` reads and tidies a
directory of links without a model. Virtual tables are held by their live rows (an incremental
link: those that changed, and the ids evicted). :func:`expand_for_load` readies a state dict
holding virtual tables for a plain ``torch.distributed.checkpoint.load`` (their live rows change
size)."""

from torchrec_mtrains.checkpoint.chain import CheckpointDirectory, on_rank0, read_link
from torchrec_mtrains.checkpoint.manager import CheckpointManager
from torchrec_mtrains.checkpoint.types import (
    DONE_FILE,
    ChainError,
    CheckpointError,
    CheckpointOptions,
    CheckpointWriteError,
    Link,
    NoLoadableLinkError,
)
from torchrec_mtrains.distributed.virtual_checkpoints import expand_for_load

__all__ = [
    "DONE_FILE",
    "ChainError",
    "CheckpointDirectory",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointOptions",
    "CheckpointWriteError",
    "Link",
    "NoLoadableLinkError",
    "expand_for_load",
    "on_rank0",
    "read_link",
]
