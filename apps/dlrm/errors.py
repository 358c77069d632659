"""Errors the user fixes by changing the command line, and how the app prints them."""

from __future__ import annotations

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration or input problem the user can fix; printed as one paragraph."""


# Errors a user fixes by changing the command line, printed as one paragraph: ours, Hydra's
# composition errors (unknown preset, bad override syntax) and OmegaConf's (unknown key,
# failed interpolation).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    HydraException,
    OmegaConfBaseException,
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
