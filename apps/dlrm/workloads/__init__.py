"""Benchmark workloads built on the app's data sources: :mod:`~apps.dlrm.workloads.w1`, the
embedding-dominated Criteo-Kaggle-shaped model, with each placement W1 compares
(:mod:`~apps.dlrm.workloads.mmap_baseline`: the FUSED kernel over memory-mapped files)."""
