"""benchmarks.vllm_dtype: vLLM is compared at its fastest dtype on the CPU unless one is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.vllm_dtype import resolve_vllm_dtype

ZEN5 = "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile avx512_bf16\n"
ZEN2 = "flags\t\t: fpu sse4_2 avx2 fma\n"


@pytest.mark.parametrize(
    ("cpuinfo", "dtype", "named"),
    [(ZEN5, "bfloat16", "avx512_bf16"), (SAPPHIRE_RAPIDS, "bfloat16", "amx_bf16"),
     (ZEN2, "float32", "no bf16 units")],
)  # fmt: skip
def test_auto_is_bf16_only_where_the_cpu_has_bf16_units(
    cpuinfo: str, dtype: str, named: str
) -> None:
    got, why = resolve_vllm_dtype("auto", cpuinfo)
    assert got == dtype and named in why


def test_a_named_dtype_wins_and_a_bad_one_is_refused() -> None:
    assert resolve_vllm_dtype("float32", ZEN5) == ("float32", "named on the command line")
    with pytest.raises(ValueError, match="--vllm-dtype 'fp16': use one of auto, float32, bfloat16"):
        resolve_vllm_dtype("fp16", ZEN5)


def test_the_benches_that_start_vllm_default_to_auto() -> None:
    from benchmarks.contention.options import ContentionOptions

    assert ContentionOptions().vllm_dtype == "auto"
    import benchmarks.serve_vs_vllm as svv

    assert 'default="auto"' in Path(svv.__file__).read_text()
