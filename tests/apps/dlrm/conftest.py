from __future__ import annotations

from collections.abc import Iterator

import pytest
from hydra.core.global_hydra import GlobalHydra


@pytest.fixture(autouse=True)
def _fresh_hydra() -> Iterator[None]:
    """Each test composes from scratch (a test that fails inside ``initialize`` leaves Hydra's
    process-wide state set)."""
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()
