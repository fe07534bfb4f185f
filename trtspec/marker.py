"""The marker file `trtspec deploy` writes into a model repository it made: the trtspec version, the build config,
the engine dirs, the backend and how `trtspec serve` launches it. Written by trtspec.deploy.writer; read here by
whatever needs to know a repository (serve's launch plan and start timeout, the Kubernetes manifests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

MARKER_FILE = "trtspec-repository.json"


def read_marker(repo: str | os.PathLike[str]) -> dict | None:
    """The repository's marker, or None where there is none (a repository not written by `trtspec deploy`)."""
    try:
        marker = json.loads((Path(repo) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "trtspec" in marker else None
