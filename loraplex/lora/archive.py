"""Safe extraction of uploaded adapter archives (``.zip``, ``.tar.gz`` / ``.tgz``, ``.tar``).

Archives come from untrusted tenants. Extraction refuses, before writing the offending member:
absolute paths, ``..`` components, backslashes and drive letters; symlinks, hardlinks, devices and
FIFOs; duplicate names; encrypted zip members; more than ``max_members`` members. Sizes declared in
headers are never trusted: file bytes are counted as they are written, and the extraction stops
the moment the total passes ``max_bytes`` (a zip bomb writes at most ``max_bytes`` bytes). For
tar, the decompressed stream itself is metered too, so a header bomb (a huge GNU long-name or pax
record, read by ``tarfile`` into memory) stops at a small fixed budget.

This module also defines :class:`AdapterError`, the one error type of adapter loading.
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Protocol

AdapterErrorCode = Literal[
    "missing_file",
    "pickle_format",
    "bad_config",
    "unsupported_target",
    "unsupported_option",
    "dora_unsupported",
    "modules_to_save",
    "bias_unsupported",
    "rank_too_large",
    "bad_safetensors",
    "bad_dtype",
    "too_large",
    "unexpected_tensor",
    "missing_tensor",
    "bad_shape",
    "base_model_mismatch",
    "nan_weights",
    "bad_archive",
    "archive_too_large",
    "unsafe_archive_member",
]

CONFIG_NAME = "adapter_config.json"
_CHUNK = 1 << 20
_MAX_DEPTH = 16
# Bytes of tar headers (512 per member, long names, pax records, padding) allowed beyond file data.
_TAR_METADATA_BUDGET = 1 << 20
_SKIPPED_PREFIXES = ("__MACOSX/",)


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


class AdapterError(ValueError):
    """An adapter (or its archive) that loraplex refuses; ``str(err)`` says what to fix.

    ``code`` is a short machine-readable reason (see :data:`AdapterErrorCode`) for API error
    bodies and metrics labels.
    """

    def __init__(self, code: AdapterErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: AdapterErrorCode = code
        self.message = message


def extract_archive(archive: Path, dest: Path, *, max_bytes: int, max_members: int = 64) -> Path:
    """Extract ``archive`` into ``dest`` and return the directory holding ``adapter_config.json``.

    ``dest`` must not exist or be an empty directory. On success the caller owns ``dest`` and
    removes it when done. On any failure everything written under ``dest`` is removed (and ``dest``
    itself when this call created it) before :class:`AdapterError` propagates.
    """
    archive, dest = Path(archive), Path(dest)
    created = not dest.exists()
    if not created and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"extraction target {dest} must not exist or be an empty directory")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        kind = _archive_kind(archive)
        writer = _Writer(dest, max_bytes, max_members)
        if kind == "zip":
            _extract_zip(archive, writer)
        else:
            _extract_tar(archive, writer, gzipped=kind == "tar.gz")
        return _find_adapter_dir(dest)
    except BaseException:
        _remove_contents(dest, remove_root=created)
        raise


def _archive_kind(archive: Path) -> Literal["zip", "tar.gz", "tar"]:
    """Decide the format from the leading bytes, never from the file name."""
    try:
        with archive.open("rb") as f:
            head = f.read(512)
    except OSError as e:
        raise AdapterError(
            "bad_archive", f"cannot read archive {archive.name}: {e.strerror}"
        ) from e
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[257:262] == b"ustar":
        return "tar"
    raise AdapterError(
        "bad_archive",
        f"{archive.name} is not a .zip, .tar.gz or .tar archive; upload the adapter directory "
        f"(adapter_config.json + adapter_model.safetensors) packed as .zip or .tar.gz",
    )


class _Writer:
    """Writes members under ``root``, enforcing the member count and the streamed byte budget."""

    def __init__(self, root: Path, max_bytes: int, max_members: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.members = 0
        self.written = 0

    def check_count(self, members: int) -> None:
        if members > self.max_members:
            raise AdapterError(
                "bad_archive",
                f"archive has more than {self.max_members} members; pack only the adapter "
                f"directory (adapter_config.json + adapter_model.safetensors)",
            )

    def count_member(self) -> None:
        self.members += 1
        self.check_count(self.members)

    def mkdir(self, parts: tuple[str, ...]) -> None:
        try:
            self.root.joinpath(*parts).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _conflict(parts, e) from e

    def write_file(self, parts: tuple[str, ...], src: _Readable) -> None:
        path = self.root.joinpath(*parts)
        # O_EXCL: a duplicate member can never overwrite an earlier one; O_NOFOLLOW: never
        # write through a link (none can exist in a fresh root, this is belt and braces).
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise _conflict(parts, e) from e
        with os.fdopen(fd, "wb") as out:
            while chunk := src.read(_CHUNK):
                self.written += len(chunk)
                if self.written > self.max_bytes:
                    raise _too_large(self.max_bytes)
                out.write(chunk)


def _conflict(parts: tuple[str, ...], err: OSError) -> AdapterError:
    return AdapterError(
        "bad_archive",
        f"archive member {'/'.join(parts)!r} cannot be written ({err.strerror}: a duplicate name, "
        f"or a file where a directory is expected); pack each file once",
    )


def _too_large(max_bytes: int) -> AdapterError:
    return AdapterError(
        "archive_too_large",
        f"archive expands to more than {max_bytes} bytes; upload only adapter_config.json and "
        f"adapter_model.safetensors, or ask the operator to raise the adapter size limit",
    )


def _member_parts(name: str) -> tuple[str, ...]:
    """The safe relative path components of a member name; refuses anything that could escape."""
    unsafe = (
        not name
        or "\x00" in name
        or "\\" in name
        or name.startswith("/")
        or (len(name) > 1 and name[1] == ":")
    )
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if unsafe or ".." in parts or not parts or len(parts) > _MAX_DEPTH:
        raise AdapterError(
            "unsafe_archive_member",
            f"archive member {name!r} has an unsafe path (absolute, '..', backslash or too deep); "
            f"pack the adapter with relative paths only, e.g. `zip -r adapter.zip my-adapter/`",
        )
    return parts


def _unsafe_type(name: str, what: str) -> AdapterError:
    return AdapterError(
        "unsafe_archive_member",
        f"archive member {name!r} is a {what}; only regular files and directories are accepted, "
        f"so replace links by the files themselves",
    )


def _extract_zip(archive: Path, writer: _Writer) -> None:
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise AdapterError("bad_archive", f"{archive.name} is not a readable zip file ({e})") from e
    with zf:
        infos = [i for i in zf.infolist() if not i.filename.startswith(_SKIPPED_PREFIXES)]
        writer.check_count(len(infos))  # the central directory is the full list: fail early
        for info in infos:
            writer.count_member()
            _extract_zip_member(zf, info, writer)


def _extract_zip_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, writer: _Writer) -> None:
    parts = _member_parts(info.filename)
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if info.is_dir():
        writer.mkdir(parts)
        return
    if kind not in (0, stat.S_IFREG):
        raise _unsafe_type(info.filename, "symlink" if stat.S_ISLNK(mode) else "special file")
    if info.flag_bits & 0x1:
        raise AdapterError(
            "bad_archive", f"archive member {info.filename!r} is encrypted; upload it unencrypted"
        )
    try:
        with zf.open(info) as src:
            writer.write_file(parts, src)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, zlib.error) as e:
        raise AdapterError(
            "bad_archive",
            f"archive member {info.filename!r} is corrupt ({e}); re-create the archive",
        ) from e


class _MeteredStream(io.RawIOBase):
    """A read-only stream that refuses to yield more than the writer's budget allows.

    Allowed = file bytes written so far + a fixed metadata budget + one chunk in flight, so
    neither file data nor tar headers can make the decompressor run away.
    """

    def __init__(self, inner: _Readable, writer: _Writer) -> None:
        self.inner = inner
        self.writer = writer
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self.inner.read(len(buffer))
        self.consumed += len(data)
        if self.consumed > self.writer.written + _TAR_METADATA_BUDGET + 2 * _CHUNK:
            raise _too_large(self.writer.max_bytes)
        buffer[: len(data)] = data
        return len(data)


def _extract_tar(archive: Path, writer: _Writer, *, gzipped: bool) -> None:
    with archive.open("rb") as raw:
        inner: _Readable = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
        stream = io.BufferedReader(_MeteredStream(inner, writer), buffer_size=64 << 10)
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tf:
                for member in _tar_members(tf):
                    _extract_tar_member(tf, member, writer)
        except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise AdapterError(
                "bad_archive", f"{archive.name} is not a readable tar archive ({e}); re-create it"
            ) from e


def _tar_members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (member := tf.next()) is not None:
        yield member


def _extract_tar_member(tf: tarfile.TarFile, member: tarfile.TarInfo, writer: _Writer) -> None:
    if member.name.startswith(_SKIPPED_PREFIXES):
        return
    writer.count_member()
    parts = _member_parts(member.name)
    if member.isdir():
        writer.mkdir(parts)
        return
    if not member.isreg():
        what = "symlink" if member.issym() else "hardlink" if member.islnk() else "special file"
        raise _unsafe_type(member.name, what)
    src = tf.extractfile(member)
    if src is None:  # only for non-regular members, excluded above
        raise _unsafe_type(member.name, "special file")
    writer.write_file(parts, src)


def _find_adapter_dir(root: Path) -> Path:
    holders = sorted({p.parent for p in root.rglob(CONFIG_NAME) if p.is_file()})
    if not holders:
        raise AdapterError(
            "missing_file",
            f"the archive holds no {CONFIG_NAME}; pack the directory written by "
            f"`model.save_pretrained(dir)` (adapter_config.json + adapter_model.safetensors)",
        )
    if len(holders) > 1:
        found = ", ".join(str(h.relative_to(root)) or "." for h in holders)
        raise AdapterError(
            "bad_archive",
            f"the archive holds several adapters ({CONFIG_NAME} in: {found}); upload one adapter "
            f"per archive",
        )
    return holders[0]


def _remove_contents(root: Path, *, remove_root: bool) -> None:
    if remove_root:
        shutil.rmtree(root, ignore_errors=True)
        return
    for child in root.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
