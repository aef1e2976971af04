"""What every bench records about the code it measured."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("proxy", "engine", "protos")


def code_version() -> dict[str, Any]:
    """The commit of this tree and its uncommitted product files (others may edit them)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout

    changed = git("status", "--porcelain", "--", *PRODUCT)
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted": [line.split(maxsplit=1)[-1] for line in changed.splitlines()],
    }
