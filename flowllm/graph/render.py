"""A validated graph as text (`flowllm graph show`) and as a Mermaid flowchart."""

from __future__ import annotations

from typing import Any

from flowllm.graph.channel import type_name
from flowllm.graph.validator import ValidGraph


def _params_text(params: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v!r}" for k, v in params.items()) + "}" if params else ""


def render_text(graph: ValidGraph) -> str:
    """Stages with their class, params, ports and process; then channels with types and
    capacity, those between processes marked."""
    lines = [f"graph {graph.name}  ({graph.spec.source})", "", "stages:"]
    width = max((len(name) for name in graph.stages), default=0)
    use_width = max((len(b.spec.use) for b in graph.stages.values()), default=0)
    for name, bound in graph.stages.items():
        extra = [_params_text(bound.spec.params)]
        if bound.spec.process is not None:
            extra.insert(0, f"process: {bound.spec.process}")
        if bound.spec.replicas > 1:
            extra.append(f"replicas: {bound.spec.replicas}")
        if bound.credit_bound is not None:
            extra.append(f"(credit bound {bound.credit_bound})")
        text = "  ".join(e for e in extra if e)
        lines.append(f"  {name:<{width}}  {bound.spec.use:<{use_width}}  {text}".rstrip())
        for port, tp in bound.cls.inputs.items():
            optional = "  (optional)" if port in bound.cls.optional_inputs else ""
            lines.append(f"  {'':<{width}}    in   {port}: {type_name(tp)}{optional}")
        for port, tp in bound.cls.outputs.items():
            optional = "  (optional)" if port in bound.cls.optional_outputs else ""
            lines.append(f"  {'':<{width}}    out  {port}: {type_name(tp)}{optional}")
        lines.append(f"  {'':<{width}}    supervision: {bound.supervision.describe()}")
    lines += ["", "channels:"]
    for channel in graph.channels.values():
        sources = ", ".join(str(p) for p in channel.producers)
        crossing = ", across processes" if channel.crosses else ""
        lines.append(
            f"  {sources} -> {channel.name}  "
            f"[{type_name(channel.message_type)}, capacity {channel.capacity}{crossing}]"
        )
    return "\n".join(lines)


def render_mermaid(graph: ValidGraph) -> str:
    """A Mermaid flowchart: one node per stage (inside a subgraph per process, when the graph
    is placed), one arrow per edge labelled port and type."""
    ids = {name: f"s{i}" for i, name in enumerate(graph.stages)}
    lines = ["flowchart LR"]
    for process in graph.processes or (None,):
        indent = "    " if process is None else "        "
        if process is not None:
            lines.append(f'    subgraph {process}["process {process}"]')
        for name, bound in graph.stages.items():
            if graph.placement.get(name) != process:
                continue
            replicas = f" ×{bound.spec.replicas}" if bound.spec.replicas > 1 else ""
            lines.append(f'{indent}{ids[name]}["{name}{replicas}<br/><i>{bound.cls.__name__}</i>"]')
        if process is not None:
            lines.append("    end")
    for edge in graph.spec.edges:
        channel = graph.channels[str(edge.dst)]
        types = type_name(graph.stages[edge.src.stage].cls.outputs[edge.src.port])
        label = f"{edge.src.port} → {edge.dst.port}<br/>{types.replace(' | ', ' or ')}"
        label += f" [{channel.capacity}]"
        lines.append(f'    {ids[edge.src.stage]} -->|"{label}"| {ids[edge.dst.stage]}')
    return "\n".join(lines)
