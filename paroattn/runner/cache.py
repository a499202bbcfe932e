"""The plan cache of `plan="auto"`: one folder of plan files, one per (model, density, quantization, block sizes).

The folder is `$PAROATTN_CACHE`, else the platform's cache folder (`$XDG_CACHE_HOME/paroattn`, by default
`~/.cache/paroattn`, on Linux; `~/Library/Caches/paroattn` on macOS; `%LOCALAPPDATA%\\paroattn` on Windows).
`clear_cache()` empties it (or `rm -r` the folder: nothing else refers to it).

An entry is written under a temporary name in the same folder and renamed, so a reader sees a whole plan or none.
The process that learns an entry holds its lock file (`<entry>.lock`, an advisory `flock`, released by the
system when that process dies); another process building the same entry finds it taken and runs dense until the
entry exists. An entry that does not load (any `PlanError`: truncated, checksum, another model) is removed, and
is learnt again.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from ..errors import PlanError
from ..modes import modes_problem
from ..plan import Plan, model_fingerprint

ENV = "PAROATTN_CACHE"
SUFFIX = ".safetensors"


def cache_folder() -> Path:
    """The folder of the plan cache (created when an entry is first written)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "paroattn"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "paroattn"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "paroattn"


def entry_name(model_class: str, model_config, *, density: float, qk: str, pv: str, block_size: int,
               query_block: int | None = None, expert: str = "") -> str:
    """The file name of the entry for a model (its class and config: the config's fingerprint) at a density,
    quantization modes and block sizes. Every field that changes the plan is in the name."""
    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density={density!r}; expected a share of the attention blocks in (0, 1]")
    if problem := modes_problem(qk, pv):
        raise ValueError(f"qk={qk!r}, pv={pv!r}: {problem}")
    query = query_block if query_block is not None else block_size
    parts = [model_class or "model", model_fingerprint(model_config), f"d{float(density):g}", f"qk-{qk}",
             f"pv-{pv}", f"b{block_size}x{query}"]
    if expert:
        parts.append(expert)
    return "_".join(parts) + SUFFIX


def entry_path(name: str, folder: str | os.PathLike | None = None) -> Path:
    """Where the entry `name` lives: in `folder`, else in `cache_folder()`."""
    return Path(folder if folder is not None else cache_folder()) / name


def load_entry(path: str | os.PathLike, fingerprint: str | None = None, log=None) -> Plan | None:
    """The cached plan at `path`, or None where there is none. A file that does not load as a plan, or a plan
    for another model than `fingerprint`, is removed (it is learnt again) and `log` says so."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        plan = Plan.load(path)
        if fingerprint is not None and plan.model_fingerprint != fingerprint:
            raise PlanError(f"{path}: made for a model with fingerprint {plan.model_fingerprint}, not {fingerprint}")
    except PlanError as exc:
        path.unlink(missing_ok=True)
        if log is not None:
            log(f"paroattn: removed the unusable cached plan {path} ({exc}); it is learnt again")
        return None
    return plan


def write_entry(plan: Plan, path: str | os.PathLike) -> Path:
    """Write `plan` at `path`: into a temporary file of the same folder, then renamed over `path` (a reader sees
    the whole plan or nothing; an interrupted write leaves no entry)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        plan.save(partial)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return path


def clear_cache(folder: str | os.PathLike | None = None) -> int:
    """Remove every cached plan (of `folder`, else of `cache_folder()`), and the leftovers of interrupted
    writes; returns the number of files removed. Lock files of entries being learnt now are kept."""
    folder = Path(folder if folder is not None else cache_folder())
    removed = 0
    if not folder.is_dir():
        return 0
    for file in folder.iterdir():
        if file.is_file() and (file.name.endswith(SUFFIX) or file.name.endswith(".partial")):
            file.unlink(missing_ok=True)
            removed += 1
    return removed


class EntryLock:
    """The lock of one entry while a process learns it: `acquire()` takes it without waiting (False: another
    process holds it); `release()` gives it back. Held through an advisory `flock` on `<entry>.lock`, so the
    system releases it when the holder dies; without `fcntl` (Windows) the file's existence is the lock, and a
    lock file older than `stale_s` counts as left by a dead process."""

    def __init__(self, path: str | os.PathLike, stale_s: float = 3600.0):
        self.path = Path(str(path) + ".lock")
        self.stale_s = stale_s
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # no advisory locks: the file itself
            return self._acquire_exclusive()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except OSError:  # held by another process, or its file removed since it was opened
            same = False
        if not same:  # a lock whose file was released and removed since it was opened is not the entry's lock
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def _acquire_exclusive(self) -> bool:
        try:
            if time.time() - self.path.stat().st_mtime > self.stale_s:
                self.path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:  # removed while held, so that a waiting process never takes a lock whose file is gone
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # closing releases the flock
