"""What a reference run needs from fbgemm that fbgemm's CPU build lacks.

TorchRec's managed-collision modules reset the row of each slot they give to a new id with
fbgemm's ``reset_embedding_weight_momentum``, which has a CUDA kernel only (and whose Python
method hands the kernel the module's device and UVM buffers, empty on CPU). So TorchRec's own
FUSED kernel cannot be the reference for these modules on CPU as it comes. :func:`reset_rows_on_cpu`
gives a CPU module the effect of the CUDA kernel, for the reference side of tests and
benchmarks only: this package never installs it on a model of its users.
"""

from __future__ import annotations

from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType

__all__ = ["reset_rows_on_cpu"]


def reset_rows_on_cpu(tbe: Any) -> None:
    """Makes ``tbe.reset_embedding_weight_momentum`` (a CPU ``SplitTableBatchedEmbeddingBags
    Codegen``) do what fbgemm's CUDA kernel does: under ``EXACT_ROWWISE_ADAGRAD`` the rows'
    weights and momentum become zero; under the other optimizers nothing happens."""

    def reset(
        pruned_indices: torch.Tensor,
        pruned_indices_offsets: torch.Tensor,
        logical_table_ids: torch.Tensor,
        buffer_ids: torch.Tensor,
    ) -> None:
        if tbe.optimizer != OptimType.EXACT_ROWWISE_ADAGRAD:
            return
        offsets = pruned_indices_offsets.tolist()
        for t, b in zip(logical_table_ids.tolist(), buffer_ids.tolist()):
            ids = pruned_indices[offsets[b] : offsets[b + 1]]
            dim = int(tbe.D_offsets[t + 1] - tbe.D_offsets[t])
            rows = int(tbe.weights_offsets[t]) + ids.unsqueeze(1) * dim + torch.arange(dim)
            tbe.weights_host[rows.flatten()] = 0
            tbe.momentum1_host[int(tbe.momentum1_offsets[t]) + ids] = 0

    tbe.reset_embedding_weight_momentum = reset
