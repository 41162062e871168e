"""The `flowllm` command: one sub-command per thing a user does.

Each sub-command's work lives in its own module and is imported only when it runs, so
`flowllm --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flowllm.version import __version__


def _serve(args: argparse.Namespace) -> int:
    from flowllm.cli.serve import serve_command

    return serve_command(args)


def _generate(args: argparse.Namespace) -> int:
    from flowllm.cli.serve import generate_command

    return generate_command(args)


def _graph_validate(args: argparse.Namespace) -> int:
    from flowllm.cli.graph import validate_command

    return validate_command(args.file)


def _graph_show(args: argparse.Namespace) -> int:
    from flowllm.cli.graph import show_command

    return show_command(args.file, mermaid_only=args.mermaid)


def _bench_serve(args: argparse.Namespace) -> int:
    from flowllm.bench.serve import serve_command

    return serve_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowllm",
        description="An OpenAI-compatible LLM server built as a dataflow graph of stages.",
    )
    parser.add_argument("--version", action="version", version=f"flowllm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from flowllm.cli.serve import add_generate_arguments, add_serve_arguments

    serve = commands.add_parser("serve", help="serve a model over the OpenAI API")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)
    generate = commands.add_parser("generate", help="generate text offline for prompts")
    add_generate_arguments(generate)
    generate.set_defaults(func=_generate)

    graph = commands.add_parser("graph", help="inspect and check stage graphs")
    graph_commands = graph.add_subparsers(dest="graph_command", required=True, metavar="ACTION")
    validate = graph_commands.add_parser("validate", help="check a graph YAML file")
    validate.add_argument("file", help="path to the graph YAML")
    validate.set_defaults(func=_graph_validate)
    show = graph_commands.add_parser("show", help="print a graph as text and Mermaid")
    show.add_argument("file", nargs="?", default=None, help="graph YAML (default: built-in)")
    show.add_argument("--mermaid", action="store_true", help="print only the Mermaid chart")
    show.set_defaults(func=_graph_show)

    from flowllm.bench.args import add_serve_arguments

    bench = commands.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    bench_serve = bench_commands.add_parser(
        "serve", help="load a server with streamed requests; report TTFT, TPOT, ITL, E2E latency"
    )
    add_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)

    from flowllm.cli.trace import add_trace_parser

    add_trace_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
