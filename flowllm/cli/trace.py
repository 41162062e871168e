"""`flowllm trace record | replay | view`: regenerate, check and look at recorded traces.

Only argparse is imported at parser-building time; the work imports torch when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_trace_parser(commands: Any) -> None:
    """Add the `trace` command and its actions to the CLI's sub-command parsers."""
    trace = commands.add_parser("trace", help="record, replay and view channel traces")
    actions = trace.add_subparsers(dest="trace_command", required=True, metavar="ACTION")

    record = actions.add_parser(
        "record",
        help="record the reference traces (tiny GPT-2) into DIR/<scenario> (`make traces`)",
        description="Record the scenarios of the committed traces. To record any other run, "
        "pass --trace-dir to `flowllm serve` or `flowllm generate`.",
    )
    record.add_argument("dir", nargs="?", help="output directory (the repository's traces/)")
    record.add_argument(
        "--scenario", action="append", default=None, help="record only this one (repeat)"
    )
    record.add_argument("--model", help="the tiny GPT-2 directory (default: rebuilt, cached)")
    record.add_argument("--list", action="store_true", help="list the scenarios and exit")
    record.set_defaults(func=record_command)

    replay = actions.add_parser(
        "replay", help="replay a trace into fresh stages and compare their outputs"
    )
    replay.add_argument("dir", help="a trace directory")
    replay.add_argument("--stage", help="replay only this stage (default: every stage)")
    replay.add_argument(
        "--model", help="load this model directory instead of the recorded/rebuilt one"
    )
    replay.add_argument("--atol", type=float, default=1e-4, help="logits tolerance (absolute)")
    replay.add_argument("--rtol", type=float, default=1e-4, help="logits tolerance (relative)")
    replay.set_defaults(func=replay_command)

    view = actions.add_parser(
        "view", help="export a trace as Chrome trace-event JSON (Perfetto) or summarise it"
    )
    view.add_argument("dir", help="a trace directory")
    view.add_argument("-o", "--output", help="write the trace-event JSON here")
    view.add_argument(
        "--summary", action="store_true", help="print per request the time in each stage/channel"
    )
    view.set_defaults(func=view_command)


def record_command(args: argparse.Namespace) -> int:
    from flowllm.traces.scenarios import SCENARIOS, ScenarioError, record_all

    if args.list:
        for name, scenario in SCENARIOS.items():
            print(f"{name:<12} {scenario.description}")
        return 0
    if not args.dir:
        print("error: give the output directory (e.g. traces)", file=sys.stderr)
        return 2
    try:
        record_all(
            Path(args.dir),
            args.scenario,
            model_dir=Path(args.model) if args.model else None,
        )
    except ScenarioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def replay_command(args: argparse.Namespace) -> int:
    from flowllm.traces.codec import TraceFormatError
    from flowllm.traces.manifest import TraceSchemaError
    from flowllm.traces.replay import ReplayError, replay_trace
    from flowllm.traces.trace_model import TraceModelError

    try:
        report = replay_trace(
            args.dir, args.stage, model=args.model, atol=args.atol, rtol=args.rtol
        )
    except (TraceSchemaError, TraceFormatError, ReplayError, TraceModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.ok else 1


def view_command(args: argparse.Namespace) -> int:
    from flowllm.traces.codec import TraceFormatError
    from flowllm.traces.manifest import TraceSchemaError
    from flowllm.traces.timeline import format_summary, summarize, write_chrome_trace
    from flowllm.traces.trace import load_trace

    if not args.output and not args.summary:
        print("error: give -o FILE, --summary, or both", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.dir)
    except (TraceSchemaError, TraceFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output:
        path = write_chrome_trace(trace, args.output)
        print(f"wrote {path} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    if args.summary:
        print(format_summary(trace, summarize(trace)))
    return 0
