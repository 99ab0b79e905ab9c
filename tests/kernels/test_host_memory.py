"""host_memory: large CPU buffers in advised 2 MiB-aligned mappings, plain torch otherwise."""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from loraplex.kernels import host_memory, packed_gemm

BIG = (1024, 1024)  # 4 MiB of float32: two huge pages
needs_thp = pytest.mark.skipif(
    not host_memory.available(), reason="this kernel gives no transparent huge pages"
)


def _vma_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("make", [host_memory.zeros, host_memory.empty])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_shape_dtype_and_writable(
    make: Callable[[Sequence[int], torch.dtype], torch.Tensor], dtype: torch.dtype
) -> None:
    t = make(BIG, dtype)
    assert t.shape == BIG and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    t[7, 9] = 3
    assert t[7, 9].item() == 3
    if make is host_memory.zeros:
        t[7, 9] = 0
        assert int(t.count_nonzero()) == 0


@needs_thp
def test_big_buffers_are_aligned_and_advised() -> None:
    t = host_memory.zeros(BIG, torch.float32)
    assert host_memory.is_huge_backed(t)
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    t.fill_(1.0)  # fault the pages in
    vma = _vma_of(t.data_ptr())
    assert vma.get("THPeligible") == "1", vma  # advised: the kernel may back it with huge pages
    assert "hg" in vma.get("VmFlags", "").split()  # the MADV_HUGEPAGE flag on the mapping


def _rss_kib(t: torch.Tensor) -> int:
    return int(_vma_of(t.data_ptr())["Rss"].split()[0])


@needs_thp
@pytest.mark.parametrize("populate", [True, False], ids=["madvise", "one-byte-per-page"])
def test_a_committed_buffer_is_resident_and_zero(
    populate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not populate:  # a kernel before 5.14: the fallback writes a byte of each page
        monkeypatch.setattr(host_memory, "_MADV_POPULATE_WRITE", -1)
    lazy = host_memory.zeros(BIG, torch.float32)
    assert _rss_kib(lazy) == 0  # nothing written: no page is taken yet
    t = host_memory.zeros(BIG, torch.float32, commit=True)
    assert host_memory.is_huge_backed(t)
    assert _rss_kib(t) >= 4096  # all 4 MiB taken before anything is written
    assert int(t.count_nonzero()) == 0


def test_small_buffers_stay_plain_torch() -> None:
    t = host_memory.zeros((16, 16), torch.float32)
    assert not host_memory.is_huge_backed(t)
    assert int(t.count_nonzero()) == 0


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "0")
    assert not host_memory.available()
    assert not host_memory.is_huge_backed(host_memory.zeros(BIG, torch.float32))


def test_bad_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{host_memory.HUGE_PAGES_ENV}='maybe': use 0"):
        host_memory.empty(BIG, torch.float32)


@needs_thp
def test_mapping_lives_as_long_as_a_view() -> None:
    t = host_memory.zeros(BIG, torch.float32)
    mapping = weakref.ref(t._loraplex_mapping)  # type: ignore[attr-defined]
    view = t[10:20]
    del t
    gc.collect()
    assert mapping() is not None  # the view still reads it
    view.fill_(2.0)
    del view
    gc.collect()
    assert mapping() is None  # unmapped with the last view


@needs_thp
def test_packed_weights_are_huge_backed_and_unchanged() -> None:
    if packed_gemm.panel_width() is None:
        pytest.skip("no native kernels")
    weight = torch.randn(1536, 576)  # [out, in]: 3.5 MiB packed
    packed = packed_gemm.pack(weight.t())
    assert packed is not None and host_memory.is_huge_backed(packed)
    x = torch.randn(5, 576)
    torch.testing.assert_close(
        packed_gemm.linear(x, weight, packed), x @ weight.t(), atol=2e-4, rtol=1e-4
    )


@needs_thp
def test_the_engine_commits_its_kv_cache_at_start(tiny_llama: str) -> None:
    from loraplex.llm import LLM

    llm = LLM(tiny_llama, kv_cache_memory=16 << 20)
    cache = llm.llm_engine.core.runner.kv_cache
    assert cache is not None and host_memory.is_huge_backed(cache)
    nbytes = cache.numel() * cache.element_size()
    assert nbytes >= 8 << 20
    assert _rss_kib(cache) * 1024 >= nbytes  # taken at start, before any request wrote to it
