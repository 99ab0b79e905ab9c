"""The child side of ``python -m benchmarks.contention``: one engine, timed runs on command.

Standard library only (torch and vLLM are imported inside functions), so that the same file is
the vLLM child: the parent copies it out of the package and runs it with vLLM's Python,
``python worker.py SPEC.json`` (``main`` below builds vLLM's ``LLM``). The loraplex
child (``child``) imports ``serve`` from here, so both systems are timed by the same
code.

Protocol: the parent writes one JSON command per line on stdin (``{"op": "run", "scenario":
"workload"}``, ``{"op": "bandwidth", "mb": 256}``, ``{"op": "exit"}``); the child answers each,
and says ``ready`` once its engine is built and warmed up, with one stdout line
``MARK + json``. The child's stdout carries nothing else: what the engine prints goes to
stderr (the parent's log of that child).

A run's step times are the wall time of each ``engine.step()`` call the offline ``generate``
loop makes (``llm_engine.step`` is wrapped on the instance, for loraplex and vLLM alike).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

MARK = "@@loraplex-contention@@ "
# The OpenMP and vLLM settings a child reports: what its runtime really read.
ENV_REPORTED = (
    "GOMP_SPINCOUNT",
    "OMP_WAIT_POLICY",
    "OMP_NUM_THREADS",
    "LORAPLEX_OMP_SPINCOUNT",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
)


class Backend(Protocol):
    """One system's engine, built and warmed up."""

    @property
    def stepper(self) -> Any:
        """The object whose ``step()`` the offline generate loop calls (it gets wrapped)."""

    def info(self) -> dict[str, Any]: ...

    def generate(
        self, prompts: list[list[int]], output_lens: list[int], adapters: list[int | None]
    ) -> list[list[int]]:
        """Greedy, EOS ignored; the output token ids of each prompt, in order."""

    def reset_prefix_cache(self) -> None: ...


class StepTimer:
    """Wraps ``engine.step`` on the instance; records each call's wall time while ``on``."""

    def __init__(self, engine: Any) -> None:
        self.on = False
        self.times: list[float] = []
        original = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - start)

        setattr(engine, "step", step)  # noqa: B010 (mypy refuses assigning to a method)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def step_stats(times: Sequence[float]) -> dict[str, Any] | None:
    if not times:
        return None
    return {
        "count": len(times),
        "total_s": round(sum(times), 4),
        "mean_ms": round(1e3 * sum(times) / len(times), 3),
        **{f"p{q}_ms": round(1e3 * percentile(times, q), 3) for q in (50, 90, 99)},
        "max_ms": round(1e3 * max(times), 3),
    }


def _proc_table() -> tuple[dict[int, int], dict[int, float]]:
    """Every process's parent and CPU seconds (user + system), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # fields 3.. of proc(5)
        except (OSError, IndexError):
            continue  # exited meanwhile
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return parent, cpu


def tree_pids(root: int) -> set[int]:
    """``root`` and its live descendants (Linux ``/proc``; elsewhere ``root`` alone)."""
    if not os.path.isdir("/proc"):
        return {root}
    parent, _ = _proc_table()
    return _descendants(root, parent)


def _descendants(root: int, parent: dict[int, int]) -> set[int]:
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds (user + system) of process ``root`` (None: this one) and its live
    descendants: vLLM runs its engine core in a child process, which ``time.process_time()``
    would miss. Linux ``/proc``; elsewhere this process alone."""
    if not os.path.isdir("/proc"):
        return time.process_time()
    root = os.getpid() if root is None else root
    parent, cpu = _proc_table()
    return sum(cpu.get(pid, 0.0) for pid in _descendants(root, parent))


def timed_run(backend: Backend, timer: StepTimer, job: dict[str, Any]) -> dict[str, Any]:
    """One timed ``generate`` over ``job`` (prompts, output_lens, adapters)."""
    lens: list[int] = job["output_lens"]
    backend.reset_prefix_cache()  # a repeat must not reuse the previous one's KV
    timer.times = []
    usage0, cpu0 = resource.getrusage(resource.RUSAGE_SELF), tree_cpu_seconds()
    timer.on = True
    start = time.perf_counter()
    outputs = backend.generate(job["prompts"], lens, job["adapters"])
    seconds = time.perf_counter() - start
    timer.on = False
    cpu, usage = tree_cpu_seconds() - cpu0, resource.getrusage(resource.RUSAGE_SELF)
    tokens = sum(len(o) for o in outputs)
    times = list(timer.times)
    result: dict[str, Any] = {
        "seconds": round(seconds, 4),
        "output_tokens": tokens,
        "expected_tokens": sum(lens),
        "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else 0.0,
        "steps": step_stats(times),
        # CPU time of every thread of this process and its children over the run: spinning
        # shows here (at most the cores' count per wall second). Context switches: this one.
        "cpu_s": round(cpu, 3),
        "cpu_per_wall": round(cpu / seconds, 3) if seconds > 0 else None,
        "voluntary_switches": usage.ru_nvcsw - usage0.ru_nvcsw,
        "involuntary_switches": usage.ru_nivcsw - usage0.ru_nivcsw,
        "outputs": outputs,
    }
    if len(lens) == 1 and len(times) >= lens[0] >= 2:
        # One request: its last n - 1 steps are its decode steps (the first made its prefill).
        decode = times[-(lens[0] - 1) :]
        result["decode_tokens_per_s"] = round(len(decode) / sum(decode), 3)
    return result


def copy_bandwidth(mb: int, tries: int = 5) -> dict[str, Any]:
    """Best of ``tries`` ``dst.copy_(src)`` of ``mb`` MB (float32) with torch's threads."""
    import torch

    n = mb * 1_000_000 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults stay out of the timing
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    moved = 2 * n * 4  # bytes read + bytes written
    return {
        "copy_bytes": n * 4,
        "best_s": round(best, 6),
        "bytes_per_s": round(moved / best),
        "convention": f"bytes read + bytes written by one torch copy_ of {mb} MB float32 "
        f"(2 x {n * 4} bytes), best of {tries}; {torch.get_num_threads()} torch threads",
    }


def environment() -> dict[str, Any]:
    return {k: os.environ.get(k) for k in ENV_REPORTED}


_protocol: list[IO[str]] = []  # the stream events go to (set by ``serve``)


def emit(event: str, **fields: Any) -> None:
    out = _protocol[0] if _protocol else sys.stdout
    out.write(MARK + json.dumps({"event": event, **fields}) + "\n")
    out.flush()


def _own_stdout() -> None:
    """Keep the real stdout for events alone: file descriptor 1 becomes stderr, so whatever
    the engine prints (vLLM logs to stdout), and its subprocesses, lands in the log in order."""
    sys.stdout.flush()
    _protocol.append(os.fdopen(os.dup(1), "w"))  # not inheritable (PEP 446)
    os.dup2(2, 1)


def serve(spec: dict[str, Any], build: Callable[[dict[str, Any]], Backend]) -> int:
    """Build the backend, say ready, then answer commands until ``exit`` or end of input."""
    _own_stdout()
    try:
        backend = build(spec)
        timer = StepTimer(backend.stepper)
        emit("ready", pid=os.getpid(), env=environment(), **backend.info())
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            if cmd["op"] == "run":
                emit("result", **timed_run(backend, timer, spec["scenarios"][cmd["scenario"]]))
            elif cmd["op"] == "bandwidth":
                emit("bandwidth", **copy_bandwidth(int(cmd["mb"])))
            else:
                raise ValueError(f"unknown command {cmd['op']!r}")
    except Exception as exc:  # the parent reports it in one line; the log keeps the trace
        traceback.print_exc()
        emit("error", message=f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        return 1
    return 0


# ---- the vLLM child ------------------------------------------------------------------------


class VLLMBackend:
    """vLLM's offline ``LLM``, built from the spec the parent wrote."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        self._params = SamplingParams
        v = spec["vllm"]
        adapters = spec["adapters"]
        lora: dict[str, Any] = (
            {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": v["max_lora_rank"]}
            if adapters
            else {}
        )
        self.llm = LLM(model=spec["model_dir"], dtype=v["dtype"], seed=0, **lora)
        self._loras = [
            LoRARequest(a["name"], k + 1, a["path"]) for k, a in enumerate(adapters)
        ]  # lora_int_id: 1, 2, ... (0 is not an adapter)
        warm = spec["warm"]
        self.generate(warm["prompts"], warm["output_lens"], warm["adapters"])

    @property
    def stepper(self) -> Any:
        return self.llm.llm_engine

    def info(self) -> dict[str, Any]:
        import vllm

        return {"system": "vllm", "vllm": vllm.__version__, **_torch_info()}

    def generate(
        self, prompts: list[list[int]], output_lens: list[int], adapters: list[int | None]
    ) -> list[list[int]]:
        params = [self._params(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
        loras = [None if k is None else self._loras[k] for k in adapters]
        outs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=loras if self._loras else None,
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def reset_prefix_cache(self) -> None:
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):
            reset()


def _torch_info() -> dict[str, Any]:
    import torch

    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python worker.py SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    return serve(spec, VLLMBackend)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
