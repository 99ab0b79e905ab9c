"""loraplex: one base model, many tenants' LoRA adapters, batched together."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loraplex.cpu_threads import configure_openmp

configure_openmp()  # before anything imports torch: OpenMP reads its wait policy once, at load

from loraplex.lora.request import LoRARequest  # noqa: E402
from loraplex.outputs import CompletionOutput, RequestOutput  # noqa: E402
from loraplex.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"

if TYPE_CHECKING:
    from loraplex.llm import LLM


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from loraplex.llm import LLM

        return LLM
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
