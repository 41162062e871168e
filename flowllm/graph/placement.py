"""Which of a graph's stages and channels one process runs, and how its channels cross
to the others.

A graph whose stages name processes runs one `Graph` (flowllm/graph/runtime.py) per
process, each built with `process=` (its own stages only) and a `Boundary`
(flowllm/graph/remote.py): a channel whose consumer runs elsewhere is a `RemoteChannel`
here, and one fed from elsewhere is a local channel the boundary's peers also send into.
Without `process=` the whole graph runs here, placed or not.
"""

from __future__ import annotations

from typing import Any

from flowllm.graph.channel import Channel
from flowllm.graph.remote import Boundary, RemoteChannel
from flowllm.graph.validator import ChannelSpec, ValidGraph


class Placement:
    """A graph's placement seen from one process (`process`, None for the whole graph)."""

    def __init__(self, graph: ValidGraph, process: str | None, boundary: Boundary | None) -> None:
        self.graph = graph
        self.process = process if graph.placement else None
        self._boundary = boundary

    def runs_here(self, stage: str) -> bool:
        """Whether `stage` runs in this process (every stage does in an unplaced run)."""
        return self.process is None or self.graph.placement[stage] == self.process

    def channels(self) -> dict[str, Channel[Any] | RemoteChannel]:
        """This process's channels: a local one into each stage here, and the send side of
        each channel that a stage here feeds into another process."""
        channels: dict[str, Channel[Any] | RemoteChannel] = {}
        for spec in self.graph.channels.values():
            if self.runs_here(spec.dst.stage):
                channels[spec.name] = Channel(spec.name, spec.message_type, spec.capacity)
            elif any(self.runs_here(p.stage) for p in spec.producers):
                process = self.graph.placement[spec.dst.stage]
                channels[spec.name] = self._boundary_for(spec).outbound(spec, process)
        return channels

    def feed_from_afar(self, channels: dict[str, Channel[Any] | RemoteChannel]) -> None:
        """Have the peers of the other processes that feed a local channel send into it (a
        sender clone each, taken before the runtime closes the channel's originals)."""
        if self.process is None:
            return
        for spec in self.graph.channels.values():
            far = {self.graph.placement[p.stage] for p in spec.producers} - {self.process}
            if far and isinstance(local := channels.get(spec.name), Channel):
                self._boundary_for(spec).inbound(spec, local, sorted(far))

    def _boundary_for(self, spec: ChannelSpec) -> Boundary:
        if self._boundary is None:
            raise ValueError(
                f"channel {spec.name!r} crosses processes, and process {self.process!r} was "
                "given no boundary to carry it"
            )
        return self._boundary
