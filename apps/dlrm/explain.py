"""The library's and the data's errors as the app explains them: one paragraph naming the file,
table or option at fault and what to change on the command line, and, once training has begun,
how a rerun carries on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from apps.dlrm.checkpoints import how_to_continue
from apps.dlrm.config import AppConfig
from apps.dlrm.data import MalformedRowError
from apps.dlrm.errors import ConfigError
from apps.dlrm.model import cache_knob
from torchrec_mtrains.cache.table_cache import CacheTooSmallError
from torchrec_mtrains.distributed.tiered_tables import TableIdError
from torchrec_mtrains.tiers.base import RowStoreError

__all__ = ["errors_explained", "explained"]


def _cause(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """``error`` or the first of its causes (a pipeline worker's error arrives wrapped) that
    is a ``kind``."""
    seen: set[int] = set()
    found: BaseException | None = error
    while found is not None and id(found) not in seen:
        if isinstance(found, kind):
            return found
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return None


def explained(app: AppConfig, error: BaseException) -> str | None:
    """``error`` as a sentence naming the file, table or option at fault and what to change,
    for the errors the data, the tiers and the caches raise; None for any other."""
    if (e := _cause(error, CacheTooSmallError)) is not None:
        # With look-ahead the cache holds ``lookahead + 1`` batches at once.
        lookahead = app.pipeline.lookahead
        also = (
            f", or lower pipeline.lookahead (now {lookahead}: the cache holds that many "
            "batches besides the running one)"
            if lookahead
            else ""
        )
        return (
            f"{e}. Raise {cache_knob(app.planner)} or lower data.batch_size "
            f"(now {app.data.batch_size}){also}."
        )
    if (e := _cause(error, MalformedRowError)) is not None:
        return (
            f"malformed data row {e} (data.on_error=fail): fix or delete that line, or pass "
            "data.on_error=skip to skip and count malformed rows."
        )
    if (e := _cause(error, TableIdError)) is not None:
        return (
            f"{e}: the data's ids must fit model.num_embeddings_per_feature "
            f"(data.kind={app.data.kind}); make them fit, give the tables more rows, or pass "
            "run.bounds_check=warn to train such ids on row 0 as TorchRec does"
        )
    if (e := _cause(error, RowStoreError)) is not None:
        return (
            f"tier storage (hardware.*): {e}. Free space there, or point hardware.tier_root / "
            "hardware.dirs at other directories."
            if "full" in str(e) or "quota" in str(e)
            else f"tier storage (hardware.*): {e}"
        )
    return None


@contextlib.contextmanager
def errors_explained(app: AppConfig, run_dir: Path | None = None) -> Iterator[None]:
    """The data's, the tiers' and the caches' errors as one-paragraph config errors
    (:func:`explained`); with ``run_dir`` (once training has begun) they also say how a
    rerun carries on: from the last finished checkpoint, or over in place."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:
        message = explained(app, e)
        if message is None:
            raise
        if run_dir is not None:
            message = f"{message.rstrip('.')}. Then {how_to_continue(run_dir)}."
        raise ConfigError(message) from None
