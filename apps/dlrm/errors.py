"""Errors the user fixes by changing the command line, and how the app prints them."""

from __future__ import annotations

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from apps.dlrm.data import MalformedRowError
from torchrec_mtrains.distributed.runtime import RankFailure
from torchrec_mtrains.distributed.tiered_tables import TableIdError


class ConfigError(ValueError):
    """A configuration or input problem the user can fix; printed as one paragraph."""


class RunDirError(ConfigError):
    """A run directory that cannot be started or resumed as asked; says what to pass."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or read; names it and the cause."""


# Errors a user fixes by changing the command line or the input, printed as one paragraph:
# ours, Hydra's composition errors (unknown preset, bad override syntax), OmegaConf's (unknown
# key, failed interpolation), and the data's own (a malformed row, an id outside its table:
# they name the file and line, or the table), which the app usually rewords first.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    HydraException,
    OmegaConfBaseException,
    MalformedRowError,
    TableIdError,
    RankFailure,  # another rank failed or stopped answering: it names the rank
)


def one_paragraph(error: BaseException) -> str:
    """The error's message as one paragraph: lines become sentences, an indented listing after
    a ``...:`` line becomes a comma-separated list, and the config search path Hydra appends to
    a missing-preset message is dropped."""
    text = str(error).split("Config search path:")[0]
    parts: list[str] = []
    listing = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if raw[:1].isspace() and parts and (listing or parts[-1].endswith(":")):
            parts[-1] += (", " if listing else " ") + line
            listing = True
            continue
        listing = False
        if parts and parts[-1][-1] not in ".:;,!?":
            parts[-1] += "."
        parts.append(line)
    return " ".join(parts) or type(error).__name__
