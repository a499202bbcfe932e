"""Checks of the folders a command writes into, made before any work starts."""

from __future__ import annotations

import tempfile
from pathlib import Path


def folder_problem(folder: str | Path, what: str, *, keep: bool = True) -> str | None:
    """Why files cannot be written into `folder`, or None. Creates the folder when missing and probes it
    with a temporary file; folders it created are removed again when the probe fails, or always when
    `keep` is False, so that a failed check leaves nothing behind."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return f"{what} {folder} is an existing file, not a folder: pass a folder path"
    missing = []
    existing = folder
    while not existing.exists() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return f"{what} {folder} cannot be created: {existing} is a file, not a folder; pass another path"
    ok = False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
        ok = True
    except OSError as exc:
        return f"{what} {folder} is not writable ({exc.strerror or exc}): pass a folder you can write to"
    finally:
        if not (ok and keep):
            for created in missing:  # innermost first
                try:
                    created.rmdir()
                except OSError:
                    break
    return None
