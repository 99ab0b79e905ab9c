"""Where loraplex keeps things on disk (a leaf: imports nothing of loraplex).

* ``cache_dir()``: what can be made again (the converted embedded model, the native kernels):
  ``$LORAPLEX_CACHE_DIR``, else ``~/.cache/loraplex``;
* ``default_data_dir()``: what cannot (the platform's database and adapters) unless
  ``--data-dir`` / ``LORAPLEX_DATA_DIR`` says otherwise: ``$XDG_DATA_HOME/loraplex``, else
  ``~/.local/share/loraplex``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of loraplex's cache: ``$LORAPLEX_CACHE_DIR`` or ``~/.cache/loraplex``."""
    env = os.environ.get("LORAPLEX_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loraplex"


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "loraplex"
