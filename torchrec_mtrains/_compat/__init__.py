"""The one seam between the library and the internals of TorchRec, fbgemm and torch.

Every private name (leading underscore) or undocumented attribute of TorchRec, fbgemm or torch
that the library relies on is reached here, by a small typed function, a typed view or a
re-export, and recorded in :data:`~torchrec_mtrains._compat.registry.REGISTRY` with where it
lives, the versions it was checked on, its expected parameters and what breaks without it. The
rest of the library calls these modules and public API only. Where one of the library's
subclasses must override a private method TorchRec calls (``_create_lookups``,
``_create_embedding_kernel``, ``_initialize_torch_state``, ``_next_batch``) or set a private
attribute TorchRec reads (``_emb_module``, ``_pipelined_forward_type``, ``_percentage``), the
override stays in the subclass and is recorded here as an overridden hook, with the
signature TorchRec calls it with.

* :mod:`.registry`: the records (:class:`~.registry.PrivateName`) and the accessor that names a
  missing one.
* :mod:`.torch_internals`: ``ShardedTensor`` and its metadata (public classes in private
  modules), process-group internals, tensor version counters, load-state-dict hook order.
* :mod:`.embedding`: TorchRec's sharded embedding modules, their shardings, grouped lookups,
  batched kernels and sharders.
* :mod:`.pipeline`: the ``TrainPipelineSparseDist`` internals the look-ahead pipeline drives.
* :mod:`.planner`: the ``EmbeddingShardingPlanner`` internals the tiered planner reads.
* :mod:`.optim`: the optimizer a TorchRec ``OptimizerWrapper`` wraps (checkpoints walk to it).

Importing this package imports nothing of TorchRec; each module imports what it reaches, so
the layers below ``distributed`` (``initializers``) import only :mod:`.torch_internals`.
``tests/distributed/test_torchrec_compat.py`` checks every record against the installed
packages: run it first on a new TorchRec (and, with ``PYTHONPATH`` pointing at another release,
on that one; see CONTRIBUTING).
"""
