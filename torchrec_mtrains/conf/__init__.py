"""Configuration shipped with the library: the host presets in ``hardware/``.

A Hydra app finds them by adding ``pkg://torchrec_mtrains.conf`` to its search path (the DLRM
app's ``conf/config.yaml`` does); :func:`torchrec_mtrains.planner.load_topology` reads them
directly.
"""
