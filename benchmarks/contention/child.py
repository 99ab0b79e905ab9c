"""The loraplex child of ``python -m benchmarks.contention``: ``python -m benchmarks.contention.child
SPEC.json``. Importing ``loraplex`` first sets the OpenMP spin count from this process's
environment (``LORAPLEX_OMP_SPINCOUNT``, which the parent chose) before torch loads; then one
``LLM`` is built and warmed up and ``worker.serve`` answers the parent's commands."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import loraplex  # noqa: F401  (first: configures OpenMP before anything loads torch)
from benchmarks.contention.worker import serve


class LoraplexBackend:
    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from loraplex import LLM, LoRARequest

        if spec["threads"]:
            torch.set_num_threads(int(spec["threads"]))
        self.llm = LLM(model=spec["model_dir"], **spec["loraplex_engine"])
        self._loras = [LoRARequest(a["name"], a["path"]) for a in spec["adapters"]]
        for req in self._loras:
            self.llm.add_lora(req)
        warm = spec["warm"]
        self.generate(warm["prompts"], warm["output_lens"], warm["adapters"])

    @property
    def stepper(self) -> Any:
        return self.llm.llm_engine

    def info(self) -> dict[str, Any]:
        import torch

        from loraplex.engine.models.layers import Linear
        from loraplex.kernels import native

        runner = self.llm.llm_engine.core.runner
        model = runner.model
        params = {id(p): p for p in model.parameters()}.values()  # tied embeddings count once
        read = sum(p.numel() * p.element_size() for p in params)
        for m in model.modules():  # a step reads a linear's packed copy, not its weight
            if isinstance(m, Linear) and m.packed is not None:
                read += m.packed.numel() * m.packed.element_size()
                read -= m.weight.numel() * m.weight.element_size()
        return {
            "system": "loraplex",
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "native_kernels": native.library() is not None,
            "weight_bytes": read,  # what one decode step reads (packed copies where they exist)
            "weight_dtype": runner.precision.name,
            "dtype_reason": runner.precision.reason,
            "num_parameters": sum(p.numel() for p in params),
        }

    def generate(
        self, prompts: list[list[int]], output_lens: list[int], adapters: list[int | None]
    ) -> list[list[int]]:
        from loraplex import SamplingParams

        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens
        ]
        loras = [None if k is None else self._loras[k] for k in adapters]
        outs = self.llm.generate(
            [list(p) for p in prompts], params, lora_request=loras, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


def main(argv: Sequence[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    return serve(spec, LoraplexBackend)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
