"""The multi-adapter options of ``loraplex bench throughput``: the arguments and what they become
in ``ThroughputOptions``.

``--num-adapters 8`` with the PEFT baselines is the four-system comparison (``multi_lora``);
``--num-adapters 1,2,4,...`` (or any run whose ``--systems`` leave PEFT out) is the adapters-at-
scale sweep (``lora_scale``): one engine per N, with and without adapters, pool stats per N.
"""

from __future__ import annotations

import argparse
from typing import Any, cast

from loraplex.argtypes import memory_size, non_negative_float, positive_int
from loraplex.bench.adapters import ADAPTER_DISTS
from loraplex.bench.systems import ADAPTER_SYSTEMS, System
from loraplex.config import MAX_LORAS, LoRAConfig


def _ints(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers such as 8 or 1,2,4; got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected integers such as 8 or 1,2,4; got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a value is repeated in {text!r}")
    return values


def count_list(text: str) -> tuple[int, ...]:
    """``8`` or ``1,2,4,8``: adapter counts of 1 or more (``0`` alone: no adapters)."""
    values = _ints(text)
    if values != (0,) and any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"must be 0 or more (a list: counts of 1 or more such as 1,2,4); got {text!r}"
        )
    return values


def rank_list(text: str) -> tuple[int, ...]:
    """``4,8,16,64``: ranks of 1 or more, repeats allowed (a cycle)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected ranks of 1 or more such as 4,8; got {text!r}")
    return values


def system_list(text: str) -> tuple[System, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ADAPTER_SYSTEMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown system {', '.join(unknown) or repr(text)}; "
            f"choose from {','.join(ADAPTER_SYSTEMS)}"
        )
    return cast(tuple[System, ...], names)


def add_adapter_arguments(a: argparse._ArgumentGroup) -> None:
    a.add_argument(
        "--num-adapters",
        type=count_list,
        default=(0,),
        metavar="N[,N...]",
        help="LoRA adapters in the workload (0: base model, loraplex vs HF generate()); a comma "
        "list (1,2,4,...,128) sweeps N in one process, one engine per N",
    )
    a.add_argument(
        "--systems",
        type=system_list,
        default=(),
        help=f"which of {','.join(ADAPTER_SYSTEMS)} to run (default: all four for one N, "
        "loraplex,loraplex_base for a sweep); without PEFT the run is the sweep",
    )
    a.add_argument(
        "--adapter-dist",
        choices=ADAPTER_DISTS,
        default=None,
        help="how requests pick adapters: request i uses i %% N (roundrobin, the default "
        "without PEFT), uniform at random (the default with PEFT), or P(k) ~ (k+1)^-alpha",
    )
    a.add_argument("--powerlaw-alpha", type=non_negative_float, default=1.0)
    a.add_argument(
        "--adapter-rank", type=positive_int, default=8, help="rank of the random adapters"
    )
    a.add_argument(
        "--adapter-ranks",
        type=rank_list,
        default=(),
        metavar="R[,R...]",
        help="ranks cycled over the adapters (4,8,16,64: mixed ranks); overrides --adapter-rank",
    )
    a.add_argument(
        "--max-loras",
        type=positive_int,
        default=None,
        help=f"distinct adapters one step may use (default: N, at most {MAX_LORAS} and what the "
        "pool holds)",
    )
    a.add_argument(
        "--max-lora-rank",
        type=positive_int,
        default=LoRAConfig.max_lora_rank,
        help="the largest adapter rank the engine accepts",
    )
    a.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=None,
        help="host cache entries (default: every registered adapter)",
    )
    a.add_argument(
        "--num-registered",
        type=positive_int,
        default=None,
        help="adapters added to each engine (default: N); requests use the first N",
    )
    pool = a.add_mutually_exclusive_group()
    pool.add_argument(
        "--lora-memory",
        type=memory_size,
        default=None,
        help="the engine's adapter pool: bytes (625MB, 2GiB) or a fraction of the KV cache "
        "(default: exactly the N adapters' real size)",
    )
    pool.add_argument(
        "--pool-adapters",
        type=positive_int,
        default=None,
        metavar="K",
        help="size the pool to the real size of adapters 0 .. K-1 (64: 64 adapters resident)",
    )
    a.add_argument(
        "--peft-mixed-batch-size",
        type=positive_int,
        default=32,
        help="batch size of the PEFT mixed-adapter baseline",
    )


def adapter_options_from(args: argparse.Namespace) -> dict[str, Any]:
    """``ThroughputOptions`` keyword arguments of the multi-adapter mode."""
    counts: tuple[int, ...] = args.num_adapters
    return {
        "num_adapters": counts[0] if len(counts) == 1 else 0,
        "adapter_counts": counts if len(counts) > 1 else (),
        "systems": args.systems,
        "adapter_dist": args.adapter_dist,
        "powerlaw_alpha": args.powerlaw_alpha,
        "adapter_rank": args.adapter_rank,
        "adapter_ranks": args.adapter_ranks,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
        "num_registered": args.num_registered,
        "lora_memory": args.lora_memory,
        "pool_adapters": args.pool_adapters,
        "peft_mixed_batch_size": args.peft_mixed_batch_size,
    }
