"""What the benchmarks in ``benchmarks/`` share, public so that other runs can measure alike.

* :mod:`~torchrec_mtrains.benchmark.memory_cap`: memory cgroups and the runner that caps a
  subprocess in one and reports its peaks (the page cache counts, so it cannot hide a tier).
* :mod:`~torchrec_mtrains.benchmark.measure`: process counters, per-thread CPU, page-cache
  eviction, timed windows, machine info and JSON results.
* :mod:`~torchrec_mtrains.benchmark.fio`: the disk's random 4 KiB rates, to judge a block tier.
* :mod:`~torchrec_mtrains.benchmark.tier_probes`: timing and counters of a running tiered model.
* :mod:`~torchrec_mtrains.benchmark.tier_files`: tier files compared by their rows.

Import the submodule you need; this package imports none of them (the tier probes pull in
TorchRec, the cgroup runner does not).
"""
