"""LoRARequest: which adapter a request uses (shaped like vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter by name and path (a directory, or a .zip / .tar.gz archive)."""

    lora_name: str
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name is empty: give the adapter a name")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path is empty: give the adapter's directory")
