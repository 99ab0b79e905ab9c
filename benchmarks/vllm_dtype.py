"""The dtype vLLM runs at in a comparison: its fastest on this CPU unless one is named.

vLLM's own CPU default turns an fp32 checkpoint into bfloat16 where the CPU has native bf16
arithmetic (AMX-BF16 or AVX512-BF16), and that is its faster dtype there (on the Zen 4 and Zen 5
VMs of docs/benchmarks.md, offline and through its server); without bf16 units bf16 is emulated
and many times slower, so fp32 is its fastest. A comparison against a slower vLLM than users run
would flatter loraplex, so ``auto`` is the default of every bench that starts vLLM.
"""

from __future__ import annotations

CHOICES = ("auto", "float32", "bfloat16")


def resolve_vllm_dtype(choice: str, cpuinfo: str | None = None) -> tuple[str, str]:
    """``(dtype, why)`` for ``--vllm-dtype choice``; ``cpuinfo``: /proc/cpuinfo's text (tests)."""
    if choice not in CHOICES:
        raise ValueError(f"--vllm-dtype {choice!r}: use one of {', '.join(CHOICES)}")
    if choice != "auto":
        return choice, "named on the command line"
    from loraplex.engine.models.precision import cpu_bf16_flags

    flags = cpu_bf16_flags(cpuinfo)
    if flags:
        return "bfloat16", f"auto: the CPU has {', '.join(flags)} (vLLM's own default there)"
    return "float32", "auto: the CPU has no bf16 units (vLLM's bf16 would be emulated)"
