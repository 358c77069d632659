"""torchrec_mtrains: train DLRMs whose embedding tables live on a DRAM / SCM / NVMe hierarchy."""

__version__ = "0.1.0"
