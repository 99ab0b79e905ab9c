"""Adapter files on disk, content-addressed by the engine's key for an adapter.

Layout under the data directory::

    adapters/<content hash>/adapter_config.json       one directory per distinct adapter content,
    adapters/<content hash>/adapter_model.safetensors shared by every version (of any tenant)
                                                       whose content hash is this one
    tmp/upload-<random>/                               one upload in flight; removed when it ends
    tmp/fetch-<hash>-<random>/                         files written from the database (replicas)

The content hash is ``LoRAAdapter.content_hash`` (SHA-256 over what the adapter computes: per
module rank and scaling, then every tensor's dtype, shape and bytes), i.e. the key the engine
and the prefix cache use. Uploads are written under ``tmp/`` (same filesystem), validated, then
renamed into ``adapters/`` in one ``rename``: a reader sees a complete directory or none. When
the content is already stored, the new copy is discarded (the files compute the same thing).

Invariant: a directory in ``adapters/`` is removed only when no ``AdapterVersion`` row names its
hash (the registry checks under its lock); ``collect`` removes directories nothing names.

Everything here is private to the server's user: directories 0700 (``adapters/`` and ``tmp/``
are made so at start even when they exist), stored files 0600.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

# PEFT's file names, as in loraplex.lora.archive (not imported here: that module imports torch,
# which the platform process loads only when it validates an adapter).
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTERS_DIR = "adapters"
TMP_DIR = "tmp"
STORED_FILES = (CONFIG_NAME, WEIGHTS_NAME)
_HASH = re.compile(r"[0-9a-f]{64}")


class AdapterStorage:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / ADAPTERS_DIR
        self.tmp = self.data_dir / TMP_DIR
        for path in (self.root, self.tmp):  # ours alone: tightened if an older version made them
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path, 0o700)

    # ---- uploads in flight -----------------------------------------------------------------

    def new_upload_dir(self) -> Path:
        path = self.tmp / f"upload-{uuid.uuid4().hex}"
        path.mkdir(mode=0o700)
        return path

    @staticmethod
    def discard(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    # ---- stored adapters -------------------------------------------------------------------

    @staticmethod
    def relative_path(content_hash: str) -> str:
        """What ``AdapterVersion.storage_path`` holds: relative to the data directory."""
        _check_hash(content_hash)
        return f"{ADAPTERS_DIR}/{content_hash}"

    def path_of(self, storage_path: str) -> Path:
        """The directory of a stored version (``storage_path`` as written by ``store``)."""
        name = storage_path.removeprefix(f"{ADAPTERS_DIR}/")
        _check_hash(name)
        return self.root / name

    def store(
        self, adapter_dir: Path, content_hash: str, work_dir: Path, replace: bool = False
    ) -> Path:
        """Move the adapter's two files from ``adapter_dir`` into ``adapters/<hash>``.

        ``work_dir`` is the upload's directory under ``tmp/`` (same filesystem as ``adapters/``).
        Returns the stored directory; an existing one is kept (same content) and ours discarded,
        unless ``replace``: then each stored file is replaced by ours, atomically (the engine's
        load of the stored copy failed: it may be damaged on disk).
        """
        target = self.root / _check_hash(content_hash)
        if target.is_dir() and replace:
            for name in STORED_FILES:
                os.chmod(adapter_dir / name, 0o600)
                _fsync(adapter_dir / name)
                if (target / name).is_dir() and not (target / name).is_symlink():
                    shutil.rmtree(target / name)  # not a file: os.replace cannot take its place
                os.replace(adapter_dir / name, target / name)
            _fsync(target)
            return target
        if target.is_dir():
            return target
        staged = work_dir / "stored"
        staged.mkdir(mode=0o700)
        for name in STORED_FILES:
            os.replace(adapter_dir / name, staged / name)
            os.chmod(staged / name, 0o600)  # received 0600; an archive member's mode is not used
            _fsync(staged / name)
        try:
            os.rename(staged, target)  # atomic: the directory appears complete or not at all
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.is_dir():
                raise
            return target  # stored meanwhile by another upload of the same content
        _fsync(self.root)
        return target

    def has(self, content_hash: str) -> bool:
        return (self.root / _check_hash(content_hash)).is_dir()

    def materialize(self, content_hash: str, write: Callable[[Path], bool]) -> bool:
        """Create ``adapters/<hash>`` from ``write(directory)`` (which writes the adapter's
        files there and says whether it had them), through a temporary directory renamed into
        place: readers see the whole directory or none. True when the directory exists after."""
        target = self.root / _check_hash(content_hash)
        if target.is_dir():
            return True
        staged = self.tmp / f"fetch-{content_hash[:16]}-{uuid.uuid4().hex[:8]}"
        staged.mkdir(mode=0o700)
        try:
            if not write(staged):
                return False
            for name in STORED_FILES:
                os.chmod(staged / name, 0o600)
                _fsync(staged / name)
            try:
                os.rename(staged, target)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.is_dir():
                    raise
                return True  # written meanwhile by another request
            _fsync(self.root)
            return True
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def remove(self, content_hash: str) -> None:
        target = self.root / _check_hash(content_hash)
        if not target.exists():
            return
        # Rename first, so a half-removed directory never sits under its hash.
        doomed = self.tmp / f"removed-{content_hash}-{uuid.uuid4().hex[:8]}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(target, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def stored_hashes(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if _HASH.fullmatch(p.name))

    def collect(self, referenced: Iterable[str]) -> list[str]:
        """Remove stored directories no version names; returns the hashes removed."""
        keep = set(referenced)
        removed = [h for h in self.stored_hashes() if h not in keep]
        for content_hash in removed:
            self.remove(content_hash)
        return removed

    def clean_tmp(self) -> int:
        """Remove everything under ``tmp/``: what uploads (and removals) a killed server left.

        Call at start only, before the server takes requests: then nothing can be writing
        there, whatever an entry's age (a server killed mid-upload leaves a fresh one).
        """
        count = 0
        for entry in self.tmp.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            count += 1
        return count


def _check_hash(content_hash: str) -> str:
    if not _HASH.fullmatch(content_hash):
        raise ValueError(f"not a content hash: {content_hash[:80]!r}")
    return content_hash


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk: the rename survives a crash."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
