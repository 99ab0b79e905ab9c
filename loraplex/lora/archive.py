"""Untrusted containers: adapter archives (``.zip``, ``.tar.gz`` / ``.tgz``, ``.tar``), the
safetensors file format and JSON, read without trusting any size, offset or name they declare.

Archives come from untrusted tenants. Extraction refuses, before writing the offending member:
absolute paths, ``..`` components, backslashes and drive letters; symlinks, hardlinks, devices and
FIFOs; duplicate names; encrypted zip members; more than ``max_members`` members. Sizes declared in
headers are never trusted: file bytes are counted as they are written, and the extraction stops
the moment the total passes ``max_bytes`` (a zip bomb writes at most ``max_bytes`` bytes). For
tar, the decompressed stream itself is metered too, so a header bomb (a huge GNU long-name or pax
record, read by ``tarfile`` into memory) stops at a small fixed budget.

A safetensors file is read here from disk (:class:`SafetensorsFile`): its header, bounded, is
parsed and verified (offsets inside the file, sizes equal to dtype × shape, ranges tiling the
data section) before a byte of tensor data is read, and tensor data is then read one tensor at a
time through a fixed-size buffer: nothing reads the weights file whole.

This module also defines :class:`AdapterError`, the one error type of adapter loading; the LoRA
meaning of the files is checked in :mod:`loraplex.lora.adapter`.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import shutil
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from loraplex.lora.errors import AdapterError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
FLOAT_DTYPES = {"F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2), "F32": (torch.float32, 4)}
_MAX_HEADER_BYTES = 8 << 20
_CHUNK = 1 << 20
_MAX_DEPTH = 16
# Bytes of tar headers (512 per member, long names, pax records, padding) allowed beyond file data.
_TAR_METADATA_BUDGET = 1 << 20
_SKIPPED_PREFIXES = ("__MACOSX/",)


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


def short_repr(value: object, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: tenant-supplied strings go into messages bounded."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
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
            self.root.joinpath(*parts).mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise _conflict(parts, e) from e

    def write_file(self, parts: tuple[str, ...], src: _Readable) -> None:
        path = self.root.joinpath(*parts)
        # O_EXCL: a duplicate member can never overwrite an earlier one; O_NOFOLLOW: never
        # write through a link (none can exist in a fresh root, this is belt and braces).
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        f"archive member {short_repr('/'.join(parts))} cannot be written ({err.strerror}: a "
        f"duplicate name, "
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
            f"archive member {short_repr(name)} has an unsafe path (absolute, '..', backslash or "
            f"too deep); "
            f"pack the adapter with relative paths only, e.g. `zip -r adapter.zip my-adapter/`",
        )
    return parts


def _unsafe_type(name: str, what: str) -> AdapterError:
    return AdapterError(
        "unsafe_archive_member",
        f"archive member {short_repr(name)} is a {what}; only regular files and directories are "
        f"accepted, "
        f"so replace links by the files themselves",
    )


def _extract_zip(archive: Path, writer: _Writer) -> None:
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise AdapterError("bad_archive", f"{archive.name} is not a readable zip file ({e})") from e
    with zf:
        infos = zf.infolist()
        writer.check_count(len(infos))  # the central directory is the full list: fail early
        for info in infos:
            if not info.filename.startswith(_SKIPPED_PREFIXES):
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
            "bad_archive",
            f"archive member {short_repr(info.filename)} is encrypted; upload it unencrypted",
        )
    try:
        with zf.open(info) as src:
            writer.write_file(parts, src)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, zlib.error) as e:
        raise AdapterError(
            "bad_archive",
            f"archive member {short_repr(info.filename)} is corrupt ({e}); re-create the archive",
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
    writer.count_member()
    if member.name.startswith(_SKIPPED_PREFIXES):
        return
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


# --- bounded reads and strict JSON ---------------------------------------------------------------


def file_too_large(name: str, limit: int) -> AdapterError:
    return AdapterError(
        "too_large",
        f"{name} is larger than {limit} bytes; lower the rank or the number of target "
        f"modules, or ask the operator to raise the adapter size limit",
    )


def read_bounded(path: Path, limit: int) -> bytes:
    """A small file (a config) read whole, refused past ``limit`` bytes."""
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise file_too_large(path.name, limit)
    return data


def loads_strict(text: bytes | str) -> Any:
    """``json.loads`` refusing duplicate keys and NaN / Infinity; every failure is ValueError."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except RecursionError as e:
        raise ValueError("nested too deeply") from e


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {short_repr(key)}")
        out[key] = value
    return out


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a number")


# --- safetensors: parsed, verified and read here, from the file ---------------------------------


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _bad_safetensors(problem: str) -> AdapterError:
    return AdapterError(
        "bad_safetensors",
        f"{WEIGHTS_NAME} is not a valid safetensors file: {problem}; re-save the adapter with "
        f"`model.save_pretrained(dir, safe_serialization=True)`",
    )


class SafetensorsFile:
    """An open safetensors file whose header is parsed and verified without trusting it.

    Layout: ``u64 little-endian N | N bytes of JSON | data``. Tensor byte ranges must tile the
    data section exactly (no gaps, no overlaps, nothing after), each as long as dtype × shape.
    Only the header is read on open (at most ``8 + _MAX_HEADER_BYTES`` bytes); tensor bytes are
    read later, one tensor at a time, through one reused buffer of ``_CHUNK`` bytes, so reading
    an adapter never holds more than one chunk of the file in memory.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self._file = path.open("rb")
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            if self.size > max_bytes:
                raise file_too_large(path.name, max_bytes)
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise
        self._buffer = bytearray(_CHUNK)  # a multiple of every dtype's element size

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def _read_header(self) -> dict[str, TensorInfo]:
        prefix = self._file.read(8)
        if len(prefix) < 8:
            raise _bad_safetensors("the file is shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER_BYTES or 8 + n > self.size:
            raise _bad_safetensors(
                f"the header length {n} exceeds the file or the {_MAX_HEADER_BYTES}-byte limit"
            )
        blob = self._file.read(n)
        if len(blob) != n:
            raise _bad_safetensors("the file ended inside its header (it changed while read)")
        try:
            header = loads_strict(blob)
        except ValueError as e:
            raise _bad_safetensors(f"the header is not valid JSON ({e})") from e
        if not isinstance(header, dict):
            raise _bad_safetensors("the header is not a JSON object")
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise _bad_safetensors("__metadata__ must map strings to strings")
        infos = {name: _tensor_info(name, e, 8 + n, self.size) for name, e in header.items()}
        _check_tiling(infos, 8 + n, self.size)
        return infos

    def chunks(self, name: str) -> Iterator[memoryview]:
        """The bytes of tensor ``name`` in order, in views of the shared buffer (each valid
        until the next is produced; each a whole number of elements)."""
        info = self.header[name]
        self._file.seek(info.begin)
        view = memoryview(self._buffer)
        remaining = info.end - info.begin
        while remaining:
            n = min(remaining, len(view))
            got = 0
            while got < n:
                read = self._file.readinto(view[got:n])
                if not read:
                    raise _bad_safetensors(
                        f"the file ended inside tensor {short_repr(name)} (it changed while read)"
                    )
                got += read
            remaining -= n
            yield view[:n]


def _tensor_info(name: str, entry: Any, start: int, stop: int) -> TensorInfo:
    """One header entry; offsets are relative to ``start``, the first byte after the header."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _bad_safetensors(
            f"entry {short_repr(name)} must have exactly dtype, shape and data_offsets"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in FLOAT_DTYPES:
        raise AdapterError(
            "bad_dtype",
            f"tensor {short_repr(name)} has dtype {short_repr(dtype)}; LoRA weights must be "
            f"float16, bfloat16 or "
            f"float32 (quantized or integer adapters are not served): re-save in one of those",
        )
    if not _int_list(shape) or len(shape) > 8 or not _int_list(offsets) or len(offsets) != 2:
        raise _bad_safetensors(f"entry {short_repr(name)} has a malformed shape or data_offsets")
    begin, end = offsets
    if not begin <= end <= stop - start:
        raise _bad_safetensors(
            f"tensor {short_repr(name)} lies outside the file (data_offsets {offsets}, "
            f"data section {stop - start} bytes)"
        )
    needed = math.prod(shape) * FLOAT_DTYPES[dtype][1]
    if end - begin != needed:
        raise _bad_safetensors(
            f"tensor {short_repr(name)} spans {end - begin} bytes, but {dtype} {shape} needs "
            f"{needed}"
        )
    return TensorInfo(dtype, tuple(shape), start + begin, start + end)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    )


def _check_tiling(infos: dict[str, TensorInfo], start: int, stop: int) -> None:
    cursor = start
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != cursor:
            raise _bad_safetensors(
                f"tensor {short_repr(name)} overlaps another tensor or leaves a gap"
            )
        cursor = info.end
    if cursor != stop:
        raise _bad_safetensors(f"{stop - cursor} bytes after the last tensor belong to no tensor")
