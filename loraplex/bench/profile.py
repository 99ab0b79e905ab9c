"""Where loraplex's time goes: one run under ``torch.profiler`` (CPU), top ops by self time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loraplex.bench.systems import greedy_params


def profile_loraplex(
    llm: Any,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    out_file: Path,
    row_limit: int = 25,
    *,
    lora_requests: Sequence[Any] | None = None,
) -> str:
    """Profile one ``generate`` over the workload (``lora_requests``: one adapter or None per
    prompt); write and return the top-ops table."""
    from torch.profiler import ProfilerActivity, profile

    params = greedy_params(output_lens)
    extra = {} if lora_requests is None else {"lora_request": list(lora_requests)}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([list(p) for p in prompts], params, use_tqdm=False, **extra)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)
    adapters = "" if lora_requests is None else " with LoRA adapters"
    header = (
        f"loraplex generate{adapters}: {len(prompts)} requests, {sum(output_lens)} output tokens; "
        "top ops by self CPU time\n"
    )
    out_file.write_text(header + table + "\n")
    return header + table
