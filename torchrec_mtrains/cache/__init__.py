"""The row caches' bookkeeping: ``table_cache`` (slot maps and per-batch plans), ``policies``
(eviction order, registered by name) and ``kernels`` (the compiled, GIL-free CPU path)."""
