"""The ``loraplex`` command: ``loraplex serve``, ``loraplex generate``, ``loraplex bench throughput``,
``loraplex db ...`` (schema migrations) and ``loraplex admin ...`` (tenants, keys, admin token).

Every failure prints one line, ``loraplex: error: ...``, and exits non-zero (2 for usage errors,
1 for everything else); set ``LORAPLEX_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from loraplex import __version__
from loraplex.argtypes import positive_int

PROG = "loraplex"


class UsageError(Exception):
    """A bad command line (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see: {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Multi-tenant LoRA serving: one base model, many adapters."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    from loraplex.server.serve import add_serve_arguments

    add_serve_arguments(
        commands.add_parser(
            "serve",
            help="serve the OpenAI-compatible API (engine in a supervised child process)",
            description="Serve MODEL (default: the embedded SmolLM2-135M-Instruct) over an "
            "OpenAI-compatible HTTP API. Every flag can also be set as LORAPLEX_<FLAG>.",
        )
    )

    gen = commands.add_parser(
        "generate",
        help="generate text for one or more prompts with the offline engine",
        description="Run prompts through the engine (batched) and print each completion.",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument(
        "--model",
        default=None,
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")

    prep = commands.add_parser(
        "prepare",
        help="convert the model and build the native kernels now (for an image build)",
        description="Do once, now, what the first start would do: convert the embedded model "
        "(or resolve MODEL) into the cache, and build the native CPU kernels. Prints the model "
        "directory.",
    )
    prep.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )

    bench = commands.add_parser("bench", help="benchmarks (results as JSON in bench-results/)")
    benches = bench.add_subparsers(dest="bench", metavar="BENCHMARK", parser_class=_Parser)
    benches.required = True
    _add_throughput(
        benches.add_parser(
            "throughput",
            help="loraplex vs Hugging Face generate() (or PEFT, with adapters) on one workload",
            description=(
                "Run one seeded workload through loraplex and through Hugging Face generate() in the "
                "same process, alternating, and report the ratio of median output tokens/s, the "
                "achieved GFLOP/s and MFU against the fp32 matmul peak measured in the same run. "
                "With --num-adapters N the workload uses N random LoRA adapters and the baselines "
                "are PEFT per-adapter and mixed-adapter batches."
            ),
        )
    )
    from loraplex.bench.fairness_options import add_fairness_arguments

    add_fairness_arguments(
        benches.add_parser(
            "fairness",
            help="tenant-fair and priority scheduling through the HTTP server, policy vs policy",
            description=(
                "Start loraplex serve once per policy and repeat (alternating) and measure, over "
                "HTTP with streaming clients: a flood from tenant A against B's occasional "
                "requests (B's p99 time to first token, total output tokens/s), the shares of "
                "two backlogged tenants with equal weights and with A's weight raised on the "
                "running server, and priority -1 requests jumping A's queue. Writes JSON and a "
                "PNG to --output-dir."
            ),
        )
    )
    from loraplex.bench.adapter_churn_options import add_churn_arguments

    add_churn_arguments(
        benches.add_parser(
            "adapter-churn",
            help="two tenants' adapter traffic against a small adapter pool, through the server",
            description=(
                "Start loraplex serve (issue 30's scenario a or b) and, over HTTP with streaming "
                "clients: tenant B's first request on a never-used adapter against warm ones, "
                "then B's time to first token alone, beside tenant A's requests on one adapter, "
                "and beside A's requests over N adapters round robin (churn); errors per tenant, "
                "engine restarts, adapter loads, evictions and deferrals against engine steps, "
                "A's throughput. Writes JSON and a PNG to --output-dir."
            ),
        )
    )
    from loraplex.bench.structured_options import add_suite_arguments

    add_suite_arguments(
        benches.add_parser(
            "structured-suite",
            help="structured output and tool calls end to end: the share of valid outputs",
            description=(
                "Start loraplex serve --demo and send, with the official openai client, JSON "
                "schemas (response_format), regex, choice and grammar constraints, tool calls "
                "(tool_choice required and named), parse() and requests that must get a 400, "
                "through the demo adapters and the base model, streamed and not; check every "
                "output and write the share of valid ones per kind as JSON to --output-dir."
            ),
        )
    )
    from loraplex.bench.structured import add_structured_arguments

    add_structured_arguments(
        benches.add_parser(
            "structured",
            help="structured output's cost: constrained vs unconstrained time per output token",
            description=(
                "On the model (offline LLM, one process): time per output token of requests "
                "constrained by a JSON schema against unconstrained ones at each batch size, "
                "in paired alternating runs (median), and a step-time trace while a slow schema "
                "compiles (other requests' steps go on). Writes JSON to --output-dir."
            ),
        )
    )
    from loraplex.bench.contention_options import add_contention_arguments

    add_contention_arguments(
        benches.add_parser(
            "contention",
            help="throughput and step times quiet and beside busy processes, per OpenMP spin "
            "count; batch 1 against the memory-bandwidth bound",
            description=(
                "Run the workload of bench throughput and a batch-1 decode quiet and with N "
                "competing busy processes, in paired alternating runs, one loraplex child "
                "process per OpenMP spin setting (optionally vLLM beside it, with "
                "--vllm-python), and report tokens/s, step-time percentiles, busy/quiet and "
                "loraplex/vLLM ratios, and batch-1 decode as a fraction of copy bandwidth / "
                "weight bytes per token. Writes JSON and Markdown to --output-dir."
            ),
        )
    )
    from loraplex.bench.speculative import add_speculative_arguments

    add_speculative_arguments(
        benches.add_parser(
            "speculative",
            help="ngram speculative decoding vs none: a copy-heavy workload and the throughput one",
            description=(
                "On the model (offline LLM, one process, two engines): tokens/s with ngram "
                "speculative decoding against none, in paired alternating runs (median), on a "
                "copy-heavy workload at batch 1 (prompts that repeat or lightly edit a passage) "
                "and on loraplex bench throughput's 64-request workload; with the acceptance "
                "rate. Writes JSON to --output-dir."
            ),
        )
    )
    from loraplex.bench.gemm import add_gemm_arguments

    add_gemm_arguments(
        benches.add_parser(
            "gemm",
            help="the packed CPU GEMM vs F.linear per row count, on the model's linear shapes",
            description=(
                "Time the native packed GEMM against F.linear (torch's BLAS) at each --rows "
                "batch size on SmolLM2-135M's linear shapes (or --shapes), weights warm, in "
                "paired alternating runs (median): the measurement behind the row count up to "
                "which the engine uses the packed kernel. Writes JSON to --output-dir."
            ),
        )
    )
    from loraplex.bench.replicas import add_replicas_arguments

    add_replicas_arguments(
        benches.add_parser(
            "replicas",
            help="data-parallel replicas: 1 vs N throughput, affinity vs round-robin routing",
            description=(
                "In one process, one engine replica on all CPUs against --replicas replicas on "
                "disjoint shares of them: output tokens/s (and per core) on bench throughput's "
                "workload; then the workload over --num-adapters random adapters in a steady "
                "mix, routed by affinity against round robin: adapter loads per replica and "
                "tokens/s. Paired alternating runs, medians. Writes JSON to --output-dir."
            ),
        )
    )
    from loraplex.bench.mask_options import add_mask_arguments

    add_mask_arguments(
        benches.add_parser(
            "masks",
            help="one tenant's costly constraint vs another tenant's TTFT, through the server",
            description=(
                "Against loraplex serve: tenant A keeps --streams requests open, in alternating "
                "windows without a constraint and with --regex; tenant B's TTFT p90 in each; "
                "the median heavy/plain ratio. Writes JSON to --output-dir."
            ),
        )
    )
    from loraplex.platform.admin_cli import add_commands as add_platform_commands

    add_platform_commands(commands, _Parser)
    return parser


def _add_throughput(p: argparse.ArgumentParser) -> None:
    from loraplex.bench.common import add_workload_arguments

    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory or org/name hub id "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    w = p.add_argument_group("workload")
    add_workload_arguments(w)
    w.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--repeats", type=positive_int, default=3, help="alternating runs per system")
    from loraplex.bench.adapter_options import add_adapter_arguments

    add_adapter_arguments(
        p.add_argument_group(
            "multi-adapter mode",
            "--num-adapters N > 0 spreads the workload over N random LoRA adapters and compares "
            "loraplex with adapters, loraplex without, and two PEFT baselines; a list of N (or "
            "--systems without PEFT) sweeps N with loraplex only and reports the adapter pool",
        )
    )
    h = p.add_argument_group("Hugging Face / PEFT baselines")
    h.add_argument(
        "--hf-batch-size", type=positive_int, default=8, help="static batch size (per adapter)"
    )
    h.add_argument(
        "--hf-max-requests",
        type=positive_int,
        default=None,
        help="run the baselines on about N requests only (with adapters: whole batches) "
        "and take their rate",
    )
    h.add_argument(
        "--skip-hf", action="store_true", help="run loraplex only (with adapters: the sweep)"
    )
    from loraplex.bench.systems import BENCH_KNOBS
    from loraplex.engine_args import add_engine_arguments

    add_engine_arguments(p.add_argument_group("loraplex engine"), names=BENCH_KNOBS)
    x = p.add_argument_group("experiments and output")
    x.add_argument(
        "--profile",
        action="store_true",
        help="also profile one loraplex run (torch.profiler, top ops by self CPU time)",
    )
    x.add_argument("--profile-requests", type=positive_int, default=16)
    x.add_argument(
        "--prefix-cache-test",
        action="store_true",
        help="also measure time to first token with a shared prefix, caching on vs off",
    )
    x.add_argument("--prefix-len", type=positive_int, default=512)
    x.add_argument("--prefix-repeats", type=positive_int, default=5)
    x.add_argument("--output-dir", default="bench-results")


def _throughput(args: argparse.Namespace) -> int:
    from loraplex.bench import EngineArgs, ThroughputOptions, run_throughput
    from loraplex.bench.adapter_options import adapter_options_from
    from loraplex.bench.systems import BENCH_KNOBS

    opts = ThroughputOptions(
        model=args.model,
        num_requests=args.num_requests,
        min_output=args.min_output,
        max_output=args.max_output,
        min_prompt_words=args.min_prompt_words,
        max_prompt_words=args.max_prompt_words,
        chat=args.chat,
        seed=args.seed,
        repeats=args.repeats,
        hf_batch_size=args.hf_batch_size,
        hf_max_requests=args.hf_max_requests,
        skip_hf=args.skip_hf,
        engine=EngineArgs({k: v for k in BENCH_KNOBS if (v := getattr(args, k)) is not None}),
        profile=args.profile,
        profile_requests=args.profile_requests,
        prefix_cache_test=args.prefix_cache_test,
        prefix_len=args.prefix_len,
        prefix_repeats=args.prefix_repeats,
        output_dir=args.output_dir,
        **adapter_options_from(args),
    )
    run_throughput(opts)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import time

    from loraplex import SamplingParams
    from loraplex.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    loaded = time.perf_counter() - start
    prompts: list[str] = list(args.prompts)
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in args.prompts
        ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = 0
    for prompt, out in zip(args.prompts, outs, strict=True):
        completion = out.outputs[0]
        tokens += len(completion.token_ids)
        print(f"### {prompt}\n{completion.text}\n[{completion.finish_reason}]\n")
    print(
        f"loraplex: model loaded in {loaded:.1f} s; {tokens} tokens in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _prepare(args: argparse.Namespace) -> int:
    import time

    from loraplex.engine.default_model import resolve_model_dir
    from loraplex.kernels import native

    start = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    print(f"{PROG}: model ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    start = time.perf_counter()
    try:
        native.build_library()
        kernels = f"built in {time.perf_counter() - start:.1f} s"
    except native.NativeBuildError as exc:  # the torch paths serve without them
        kernels = f"not built ({_one_line(exc)}); the torch paths will be used"
    print(f"{PROG}: native CPU kernels {kernels}", file=sys.stderr)
    print(model_dir)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from loraplex.server.serve import run_serve

    return run_serve(args)


def _fail(message: str, code: int = 1) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())  # newlines in library messages would break "one line"
    return text or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code (0 on success)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(args_list)
        # A word of blanks is no argument: KServe's vLLM template passes one (its Go template
        # leaves "\ " in the line its shell evals), and vLLM's launchers must run unchanged.
        extra = [word for word in extra if word.strip()]
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "serve":
            return _serve(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "bench" and args.bench == "throughput":
            return _throughput(args)
        if args.command == "bench" and args.bench == "fairness":
            from loraplex.bench.fairness import run_fairness
            from loraplex.bench.fairness_options import options_from as fairness_options

            run_fairness(fairness_options(args))
            return 0
        if args.command == "bench" and args.bench == "adapter-churn":
            from loraplex.bench.adapter_churn import run_adapter_churn
            from loraplex.bench.adapter_churn_options import options_from as churn_options

            run_adapter_churn(churn_options(args))
            return 0
        if args.command == "bench" and args.bench == "structured-suite":
            from loraplex.bench.structured_options import options_from as suite_options
            from loraplex.bench.structured_suite import run_suite

            result = run_suite(suite_options(args))
            return 0 if result["totals"]["all"]["valid"] == result["totals"]["all"]["n"] else 1
        if args.command == "bench" and args.bench == "structured":
            from loraplex.bench.structured import options_from as structured_options
            from loraplex.bench.structured import run_structured

            run_structured(structured_options(args))
            return 0
        if args.command == "bench" and args.bench == "contention":
            from loraplex.bench.contention import run_contention
            from loraplex.bench.contention_options import options_from as contention_options

            run_contention(contention_options(args))
            return 0
        if args.command == "bench" and args.bench == "speculative":
            from loraplex.bench.speculative import options_from as speculative_options
            from loraplex.bench.speculative import run_speculative

            run_speculative(speculative_options(args))
            return 0
        if args.command == "bench" and args.bench == "gemm":
            from loraplex.bench.gemm import options_from as gemm_options
            from loraplex.bench.gemm import run_gemm

            run_gemm(gemm_options(args))
            return 0
        if args.command == "bench" and args.bench == "replicas":
            from loraplex.bench.replicas import options_from as replicas_options
            from loraplex.bench.replicas import run_replicas

            run_replicas(replicas_options(args))
            return 0
        if args.command == "bench" and args.bench == "masks":
            from loraplex.bench.mask_fairness import run_masks
            from loraplex.bench.mask_options import options_from as mask_options

            return 0 if run_masks(mask_options(args))["summary"]["met"] else 1
        if args.command in ("db", "admin"):
            from loraplex.platform.admin_cli import run as run_platform_command

            return run_platform_command(args)
        raise UsageError(f"unknown command: {' '.join(args_list)}")
    except UsageError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        if os.environ.get("LORAPLEX_DEBUG"):
            raise
        from loraplex.engine.default_model import ModelResolutionError
        from loraplex.platform.db.migrate import MigrationError
        from loraplex.platform.errors import APIError

        known = isinstance(
            e,
            ModelResolutionError
            | MigrationError
            | APIError
            | ValueError
            | OSError
            | ImportError
            | MemoryError,
        )
        prefix = "" if known else f"{type(e).__name__}: "
        print(f"{PROG}: error: {prefix}{_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
