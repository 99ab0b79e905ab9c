"""Receive a multipart adapter upload, streamed to disk under a byte limit.

The body is parsed as it arrives (``python-multipart``, in a worker thread, chunk by chunk) and
file parts are written straight into the upload's directory under ``<data_dir>/tmp/``. Nothing is
buffered whole in memory, and nothing beyond ``max_bytes`` of file data is ever written: the
upload stops with 413 the moment the limit is passed (or at once, when ``Content-Length`` already
says so).

A file part's role comes from its file name, which is used for nothing else (parts are stored
under fixed names): ``adapter_config.json``, ``*.safetensors`` (the weights), or one archive
(``.zip``, ``.tar.gz`` / ``.tgz``, ``.tar``). Pickle checkpoints (``.bin``, ``.pt``, ...) are
refused before a byte of them is stored. ``README.md`` (which PEFT writes beside the adapter) is
skipped. Text parts are collected as fields; the caller decides which it reads.

At most ``max_concurrent_uploads`` uploads are received and validated at once (``UploadSlots``);
one more is answered 429 ``too_many_uploads`` before a byte of its body is read, so concurrent
uploads bound the disk traffic and the memory in use (one read buffer each).
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import anyio.to_thread

from loraplex.platform.errors import APIError, clip
from loraplex.platform.registry.storage import CONFIG_NAME, WEIGHTS_NAME

try:
    from python_multipart.multipart import MultipartParser, parse_options_header
except ImportError:  # python-multipart < 0.0.13 installs the module as ``multipart``
    from multipart.multipart import (  # type: ignore[no-redef]
        MultipartParser,
        parse_options_header,
    )

FileRole = Literal["config", "weights", "archive"]
STORED_NAME: dict[FileRole, str] = {
    "config": CONFIG_NAME,
    "weights": WEIGHTS_NAME,
    "archive": "upload.archive",
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
SKIPPED_FILES = ("readme.md",)
MULTIPART_SLACK = 64 * 1024  # part headers and boundaries beyond the files' bytes
MAX_FIELD_BYTES = 16 * 1024
MAX_PARTS = 16
# The upload endpoints: they stream and limit their own bodies (see ``streams_own_body``).
UPLOAD_PATH = re.compile(r"/v1/adapters|/admin/api/tenants/[^/]+/adapters|/admin/adapters/upload")
ACCEPTED = (
    f"upload {CONFIG_NAME} and {WEIGHTS_NAME} as two files, or one .zip / .tar.gz / .tar "
    "archive of the adapter directory"
)


@dataclass
class ReceivedUpload:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[FileRole, Path] = field(default_factory=dict)
    file_bytes: int = 0


def streams_own_body(scope: Any) -> bool:
    """Whether an ASGI request is an adapter upload: its body may exceed the server's JSON body
    limit, because the upload streams it to disk under ``max_adapter_bytes`` itself."""
    return scope.get("method") == "POST" and bool(UPLOAD_PATH.fullmatch(scope.get("path", "")))


def too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"The adapter upload is larger than this server accepts ({max_bytes} bytes); lower the "
        "rank or the number of target modules, or ask the operator to raise "
        "LORAPLEX_MAX_ADAPTER_BYTES.",
        param="file",
        code="adapter_too_large",
    )


UPLOAD_RETRY_AFTER_S = 5


class UploadSlots:
    """At most ``limit`` uploads in flight in this process (received, validated, stored).

    ``hold()`` is entered on the event loop (a plain counter is safe there) and its slot is
    given back however the upload ends: success, a refusal, a client disconnect (cancellation)
    or a bug.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent_uploads must be at least 1; got {limit}")
        self.limit = limit
        self.active = 0

    @contextmanager
    def hold(self) -> Iterator[None]:
        if self.active >= self.limit:
            raise APIError(
                429,
                f"This server is already receiving {self.limit} adapter upload(s), as many as "
                f"it takes at once; retry in {UPLOAD_RETRY_AFTER_S} s (Retry-After), or ask the "
                "operator to raise LORAPLEX_MAX_CONCURRENT_UPLOADS.",
                param="file",
                code="too_many_uploads",
                headers={"Retry-After": str(UPLOAD_RETRY_AFTER_S)},
            )
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1


def pickle_refused(filename: str) -> APIError:
    return APIError(
        400,
        f"{clip(filename, 60)} is a pickle-format checkpoint, which loraplex never loads "
        "(unpickling can run arbitrary code); save the adapter with "
        f"`model.save_pretrained(dir, safe_serialization=True)` and upload {WEIGHTS_NAME}.",
        param="file",
        code="pickle_format",
    )


def file_role(filename: str) -> FileRole | None:
    """The role of an uploaded file from its (client-given) name; None: skip it."""
    base = filename.replace("\\", "/").rsplit("/", 1)[-1].lower()
    if base.endswith(PICKLE_SUFFIXES):
        raise pickle_refused(base)
    if base == CONFIG_NAME:
        return "config"
    if base.endswith(".safetensors"):
        return "weights"
    if base.endswith(ARCHIVE_SUFFIXES):
        return "archive"
    if base in SKIPPED_FILES:
        return None
    raise APIError(
        400,
        f"Unexpected file {clip(base, 60)} in the upload; {ACCEPTED}.",
        param="file",
        code="unexpected_file",
    )


def check_content_length(headers: Any, max_bytes: int) -> None:
    """413 at once when the declared body is larger than any acceptable upload."""
    declared = headers.get("content-length") or ""
    # ASCII digits only (int() refuses '²'); past 19 digits it is past any limit: no huge int
    if (
        declared.isascii()
        and declared.isdigit()
        and (len(declared) > 19 or int(declared) > max_bytes + MULTIPART_SLACK)
    ):
        raise too_large(max_bytes)


def boundary_of(content_type: str | None) -> bytes:
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise APIError(
            400,
            "An adapter upload is a multipart/form-data request (curl -F name=my-adapter "
            "-F file=@adapter.zip); this request has another Content-Type.",
            code="invalid_content_type",
        )
    return boundary


class _Receiver:
    """``python-multipart`` callbacks writing file parts into ``directory`` (in a worker
    thread). Invariant: ``written <= max_bytes`` bytes of file data ever reach the disk."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.result = ReceivedUpload()
        self.parts = 0
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._field_name: str | None = None
        self._field_value = bytearray()
        self._file: IO[bytes] | None = None
        self._skip = False
        self.done = False

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_end": self.on_end,
        }

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise APIError(
                400,
                f"The upload has more than {MAX_PARTS} parts; {ACCEPTED}.",
                code="too_many_parts",
            )
        self._headers = {}
        self._field_name, self._field_value = None, bytearray()
        self._file, self._skip = None, False

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[bytes(self._header_field).lower()] = bytes(self._header_value)
        self._header_field, self._header_value = bytearray(), bytearray()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        if filename is None:
            self._field_name = name
            return
        text = filename.decode("utf-8", "replace")
        role = file_role(text) if text else None
        if role is None:
            self._skip = True
            return
        files = self.result.files
        # one config and one weights file, or one archive alone
        if role in files or "archive" in files or (role == "archive" and files):
            raise APIError(
                400,
                f"The upload holds {clip(text, 60)} besides another file of the same kind or "
                f"an archive; {ACCEPTED}.",
                param="file",
                code="unexpected_file",
            )
        path = self.directory / STORED_NAME[role]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        self._file = os.fdopen(os.open(path, flags, 0o600), "wb")
        self.result.files[role] = path

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        size = end - start
        if self._file is not None:
            self.result.file_bytes += size
            if self.result.file_bytes > self.max_bytes:
                raise too_large(self.max_bytes)
            self._file.write(data[start:end])
        elif self._field_name is not None and not self._skip:
            self._field_value += data[start:end]
            if len(self._field_value) > MAX_FIELD_BYTES:
                raise APIError(
                    400,
                    f"The form field {clip(self._field_name, 40)} is longer than "
                    f"{MAX_FIELD_BYTES} bytes; send adapter files as file parts (with a "
                    "filename) and keep text fields short.",
                    param=self._field_name[:40],
                    code="field_too_large",
                )

    def on_part_end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        elif self._field_name is not None and not self._skip:
            value = self._field_value.decode("utf-8", "replace")
            self.result.fields.setdefault(self._field_name, value)

    def on_end(self) -> None:
        self.done = True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


async def receive_upload(
    stream: AsyncIterator[bytes], content_type: str | None, directory: Path, max_bytes: int
) -> ReceivedUpload:
    """Parse the multipart body from ``stream`` into ``directory`` (which the caller removes,
    whatever happens). Raises ``APIError``: 413 past ``max_bytes`` of file data, 400 for a
    malformed body, a pickle file, or files that are not an adapter."""
    directory.mkdir(mode=0o700)
    receiver = _Receiver(directory, max_bytes)
    parser = MultipartParser(boundary_of(content_type), receiver.callbacks())  # type: ignore[arg-type]
    body_bytes = 0
    try:
        async for chunk in stream:
            body_bytes += len(chunk)
            if body_bytes > max_bytes + MULTIPART_SLACK:
                raise too_large(max_bytes)
            if chunk:
                await anyio.to_thread.run_sync(parser.write, chunk)
        await anyio.to_thread.run_sync(parser.finalize)
    except APIError:
        raise
    except Exception as exc:  # python-multipart's parse errors
        if type(exc).__module__.split(".")[0] not in ("multipart", "python_multipart"):
            raise
        raise APIError(
            400,
            f"The multipart body could not be parsed ({clip(str(exc), 100)}); send it with "
            "curl -F or an HTTP library's multipart support.",
            code="invalid_multipart",
        ) from None
    finally:
        receiver.close()
    if not receiver.done:
        raise APIError(
            400,
            "The multipart body ended before its closing boundary; send the whole upload.",
            code="invalid_multipart",
        )
    return receiver.result
