"""Stored adapters' files in the database (``adapter_blobs``), for replicas that share no disk.

With ``--shared-state database`` an upload's two files go into the database too, in chunks of
``CHUNK_BYTES`` keyed by (content hash, file name, chunk number), before its version is ready;
a replica asked to serve a version whose ``adapters/<hash>/`` it does not have writes them out
(``AdapterStorage.materialize``: a temporary directory renamed into place) before the engine
loads it. Rows go in the transaction that leaves their content unnamed by any version. Size is
bounded by the upload limit (``max_adapter_bytes``); reading and writing hold one chunk at a time.
Every function takes a session: call them through ``Database.run`` (a worker thread).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import AdapterBlob
from loraplex.platform.registry.storage import STORED_FILES

CHUNK_BYTES = 4 * 1024 * 1024


def stored(session: Session, content_hash: str) -> bool:
    query = select(AdapterBlob.chunk).where(AdapterBlob.content_sha256 == content_hash)
    return session.scalars(query.limit(1)).first() is not None


def save(session: Session, content_hash: str, directory: Path) -> None:
    """Copy ``directory``'s adapter files into the database (nothing when already there)."""
    if stored(session, content_hash):
        return
    for name in STORED_FILES:
        with open(directory / name, "rb") as file:
            chunk = 0
            while True:
                data = file.read(CHUNK_BYTES)
                if not data and chunk > 0:
                    break
                row = AdapterBlob(
                    content_sha256=content_hash, file_name=name, chunk=chunk, data=data
                )
                session.add(row)
                session.flush()
                session.expunge(row)  # one chunk in memory at a time
                chunk += 1
                if len(data) < CHUNK_BYTES:
                    break


def write_out(session: Session, content_hash: str, directory: Path) -> bool:
    """Write the stored files of ``content_hash`` into ``directory``; False when the database
    has none (the content was never shared, or is gone)."""
    if not stored(session, content_hash):
        return False
    for name in STORED_FILES:
        chunks = session.scalars(
            select(AdapterBlob.chunk)
            .where(AdapterBlob.content_sha256 == content_hash, AdapterBlob.file_name == name)
            .order_by(AdapterBlob.chunk)
        ).all()
        if not chunks:
            return False
        with open(directory / name, "wb") as file:
            for chunk in chunks:
                data = session.scalar(
                    select(AdapterBlob.data).where(
                        AdapterBlob.content_sha256 == content_hash,
                        AdapterBlob.file_name == name,
                        AdapterBlob.chunk == chunk,
                    )
                )
                file.write(data or b"")
    return True


def drop(session: Session, hashes: Iterable[str]) -> None:
    wanted = list(hashes)
    if wanted:
        session.execute(delete(AdapterBlob).where(AdapterBlob.content_sha256.in_(wanted)))


def all_hashes(session: Session) -> list[str]:
    return list(session.scalars(select(AdapterBlob.content_sha256).distinct()))
