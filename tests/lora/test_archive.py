"""Safe extraction of untrusted adapter archives: traversal, links, bombs, limits, cleanup."""

from __future__ import annotations

import gzip
import io
import stat
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from loraplex.lora.archive import AdapterError, extract_archive

CONFIG = b'{"peft_type": "LORA"}'
MB = 1 << 20


def make_zip(path: Path, members: dict[str, bytes], *, method: int = zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def add_tar_member(tf: tarfile.TarFile, name: str, data: bytes = b"", **attrs: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    tf.addfile(info, io.BytesIO(data) if data else None)


def make_tgz(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            add_tar_member(tf, name, data)
    return path


def refused(archive: Path, dest: Path, code: str, **limits: int) -> AdapterError:
    limits.setdefault("max_bytes", 10 * MB)
    with pytest.raises(AdapterError) as info:
        extract_archive(archive, dest, **limits)
    assert info.value.code == code, info.value
    assert not dest.exists(), "a failed extraction must leave nothing behind"
    return info.value


def test_extracts_nested_directory(tmp_path: Path) -> None:
    members = {"my-adapter/adapter_config.json": CONFIG, "my-adapter/weights": b"w" * 1000}
    for archive in (make_zip(tmp_path / "a.zip", members), make_tgz(tmp_path / "a.tgz", members)):
        dest = tmp_path / f"out-{archive.suffix}"
        found = extract_archive(archive, dest, max_bytes=MB)
        assert found == dest / "my-adapter"
        assert (found / "adapter_config.json").read_bytes() == CONFIG
        assert (found / "weights").read_bytes() == b"w" * 1000


def test_plain_tar_and_macos_junk(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tf:
        add_tar_member(tf, "adapter_config.json", CONFIG)
        add_tar_member(tf, "__MACOSX/._adapter_config.json", b"junk")
    found = extract_archive(archive, tmp_path / "out", max_bytes=MB)
    assert found == tmp_path / "out"
    assert sorted(p.name for p in found.iterdir()) == ["adapter_config.json"]


@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "/tmp/evil", "C:/evil", "a\\..\\evil"])
def test_zip_path_traversal_refused(tmp_path: Path, name: str) -> None:
    archive = make_zip(tmp_path / "a.zip", {"adapter_config.json": CONFIG, name: b"pwned"})
    err = refused(archive, tmp_path / "out" / "x", "unsafe_archive_member")
    assert "relative paths" in str(err)
    assert not (tmp_path / "evil").exists() and not (tmp_path / "out" / "evil").exists()


def test_tar_traversal_and_absolute_refused(tmp_path: Path) -> None:
    for i, name in enumerate(["../evil", "/evil"]):
        archive = make_tgz(tmp_path / f"a{i}.tgz", {"adapter_config.json": CONFIG, name: b"x"})
        refused(archive, tmp_path / "out", "unsafe_archive_member")
    assert not (tmp_path / "evil").exists()


@pytest.mark.parametrize(
    ("kind", "what"),
    [(tarfile.SYMTYPE, "symlink"), (tarfile.LNKTYPE, "hardlink"), (tarfile.CHRTYPE, "special")],
)
def test_tar_links_and_devices_refused(tmp_path: Path, kind: bytes, what: str) -> None:
    archive = tmp_path / "a.tgz"
    with tarfile.open(archive, "w:gz") as tf:
        add_tar_member(tf, "adapter_config.json", CONFIG)
        add_tar_member(tf, "adapter_model.safetensors", type=kind, linkname="/etc/passwd")
    err = refused(archive, tmp_path / "out", "unsafe_archive_member")
    assert what in str(err)


def test_zip_symlink_refused(tmp_path: Path) -> None:
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("adapter_config.json", CONFIG)
        link = zipfile.ZipInfo("adapter_model.safetensors")
        link.create_system = 3
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, "/etc/passwd")
    assert "symlink" in str(refused(archive, tmp_path / "out", "unsafe_archive_member"))


def test_too_many_members(tmp_path: Path) -> None:
    members = {f"f{i}": b"" for i in range(10)} | {"adapter_config.json": CONFIG}
    refused(make_zip(tmp_path / "a.zip", members), tmp_path / "o1", "bad_archive", max_members=8)
    refused(make_tgz(tmp_path / "a.tgz", members), tmp_path / "o2", "bad_archive", max_members=8)


def test_zip_bomb_stops_at_limit(tmp_path: Path) -> None:
    archive = make_zip(tmp_path / "bomb.zip", {"adapter_config.json": CONFIG, "z": bytes(50 * MB)})
    assert archive.stat().st_size < 200_000
    start = time.perf_counter()
    err = refused(archive, tmp_path / "out", "archive_too_large", max_bytes=10 * MB)
    assert time.perf_counter() - start < 5
    assert "10485760 bytes" in str(err)


def test_zip_lying_about_its_size(tmp_path: Path) -> None:
    """A member whose headers declare 10 bytes but whose data inflates to 20 MB."""
    archive = make_zip(tmp_path / "a.zip", {"adapter_config.json": CONFIG, "z": bytes(20 * MB)})
    raw = bytearray(archive.read_bytes())
    real = (20 * MB).to_bytes(4, "little")
    assert raw.count(real) == 2  # local header and central directory
    archive.write_bytes(bytes(raw).replace(real, (10).to_bytes(4, "little")))
    refused(archive, tmp_path / "out", "bad_archive", max_bytes=MB)


def test_tar_gz_bomb_stops_at_limit(tmp_path: Path) -> None:
    archive = make_tgz(tmp_path / "bomb.tgz", {"adapter_config.json": CONFIG, "z": bytes(50 * MB)})
    refused(archive, tmp_path / "out", "archive_too_large", max_bytes=10 * MB)


def test_tar_header_bomb_is_metered(tmp_path: Path) -> None:
    """A GNU long-name record of 200 MB, which tarfile would read into memory, stops early."""
    header = tarfile.TarInfo("././@LongLink")
    header.type = tarfile.GNUTYPE_LONGNAME
    header.size = 200 * MB
    block = header.tobuf(format=tarfile.GNU_FORMAT)
    archive = tmp_path / "bomb.tgz"
    with gzip.open(archive, "wb", compresslevel=1) as f:
        f.write(block)
        for _ in range(200):
            f.write(bytes(MB))
    refused(archive, tmp_path / "out", "archive_too_large", max_bytes=10 * MB)


def test_duplicate_member_refused(tmp_path: Path) -> None:
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as zf, pytest.warns(UserWarning):
        zf.writestr("adapter_config.json", CONFIG)
        zf.writestr("adapter_config.json", b'{"peft_type": "EVIL"}')
    assert "duplicate" in str(refused(archive, tmp_path / "out", "bad_archive"))


def test_encrypted_zip_member_refused(tmp_path: Path) -> None:
    archive = make_zip(tmp_path / "a.zip", {"adapter_config.json": CONFIG})
    raw = bytearray(archive.read_bytes())
    local, central = raw.index(b"PK\x03\x04"), raw.index(b"PK\x01\x02")
    raw[local + 6] |= 0x1  # general purpose flag bit 0: encrypted
    raw[central + 8] |= 0x1
    archive.write_bytes(bytes(raw))
    assert "encrypted" in str(refused(archive, tmp_path / "out", "bad_archive"))


def test_adapter_dir_must_be_unique(tmp_path: Path) -> None:
    two = make_zip(
        tmp_path / "two.zip", {"a/adapter_config.json": CONFIG, "b/adapter_config.json": CONFIG}
    )
    assert "several adapters" in str(refused(two, tmp_path / "o1", "bad_archive"))
    none = make_zip(tmp_path / "none.zip", {"a/README.md": b"hi"})
    refused(none, tmp_path / "o2", "missing_file")


def test_not_an_archive(tmp_path: Path) -> None:
    path = tmp_path / "adapter.zip"
    path.write_bytes(b"\x80\x04pickle, not a zip" * 40)
    assert ".tar.gz" in str(refused(path, tmp_path / "out", "bad_archive"))
    truncated = tmp_path / "t.zip"
    truncated.write_bytes(
        make_zip(tmp_path / "ok.zip", {"adapter_config.json": CONFIG}).read_bytes()[:30]
    )
    refused(truncated, tmp_path / "out", "bad_archive")


def test_existing_empty_dest_is_emptied_not_removed(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    archive = make_zip(
        tmp_path / "a.zip", {"ok/adapter_config.json": CONFIG, "ok/x": b"1", "../evil": b""}
    )
    with pytest.raises(AdapterError):
        extract_archive(archive, dest, max_bytes=MB)
    assert dest.is_dir() and not any(dest.iterdir())


def test_non_empty_dest_rejected(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_text("mine")
    archive = make_zip(tmp_path / "a.zip", {"adapter_config.json": CONFIG})
    with pytest.raises(ValueError, match="empty"):
        extract_archive(archive, dest, max_bytes=MB)
    assert (dest / "keep").read_text() == "mine"
