"""Checks of the folders and files a command writes, made before any work starts, and writing outputs so that
an interrupted command never leaves a user's earlier file half replaced."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
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


def existing_outputs(paths) -> list[Path]:
    """Those of `paths` that exist already (files a command would replace)."""
    return [Path(path) for path in paths if Path(path).exists()]


def replace_problem(paths, flag: str) -> str | None:
    """Why a command that writes `paths` (an output and its siblings) must not start, or None: one of them
    exists and would be replaced. `flag` names the option that chose them (e.g. "--out")."""
    found = existing_outputs(paths)
    if not found:
        return None
    more = f" (and {len(found) - 1} more of its outputs)" if len(found) > 1 else ""
    return (f"{flag}: {found[0]} exists{more} and would be replaced: pass --overwrite to replace it, or choose another "
            f"{flag}")


def _partial_path(target: Path) -> Path:
    """A hidden name beside `target` for its file while it is written, ending in the same suffix (writers choose
    their format by it: imageio, export_to_video)."""
    token = os.urandom(4).hex()
    return target.with_name(f".{target.name}.partial-{token}{target.suffix}")


@contextmanager
def written_together(*targets: str | Path):
    """Write files under temporary names and give each its real name only once every one is written: yields one
    temporary path per target (in the same folder, so the rename is atomic); on leaving without an error, each is
    renamed onto its target, replacing any earlier file only then; on an error (or an interrupt) the temporary files
    are removed and the targets are left as they were. A process killed while writing leaves the earlier files
    whole (and, at worst, a hidden `.NAME.partial-*` file beside them)."""
    targets = [Path(target) for target in targets]
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    partial = [_partial_path(target) for target in targets]
    try:
        yield partial
        for path, target in zip(partial, targets):
            if path.exists():  # a writer that wrote nothing leaves its target as it was
                os.replace(path, target)
    finally:
        for path in partial:
            if path.exists():
                path.unlink()
