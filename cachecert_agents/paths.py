"""Where cachecert-agents keeps what it downloads and builds (models, statistics, mappers, certificates).

The root is ``$CACHECERT_HOME`` when set, else ``$XDG_CACHE_HOME/cachecert-agents``, else
``~/.cache/cachecert-agents``. Nothing under it is committed to a repository; every file there can be rebuilt
by a documented command (``cachecert models install``, ``cachecert calibrate``, ...).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "CACHECERT_HOME"


def cache_home() -> Path:
    """Root of the user cache directory (created on first use)."""
    env = os.environ.get(ENV_HOME)
    if env:
        root = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "cachecert-agents"
    root.mkdir(parents=True, exist_ok=True)
    return root


def models_dir() -> Path:
    """Directory holding one sub-directory per installed embedded model."""
    path = cache_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
