"""Cross-process transports for the graph's channels, measured with the graph's own messages.

A channel that crosses a process boundary moves msgspec structs encoded with
`msgspec.msgpack`. This measures what each transport costs for them, sender and receiver
in two processes (spawned, never forked), each measurement in its own pair:

- `unix`: a Unix domain socket stream through anyio (`anyio.create_unix_listener`,
  `anyio.connect_unix`), each message a frame of a 4-byte length and the bytes; the
  receiver reads what is there (64 KiB at most) and splits every whole frame out of it.
- `unix-buffered`: the same socket, read with anyio's `BufferedByteReceiveStream`
  (`receive_exactly` of the length, then of the body): the obvious way to write it.
- `zmq`: pyzmq over `ipc://` with `zmq.asyncio`, PUSH/PULL one way, PAIR for ping-pong;
  ZeroMQ frames the messages itself.
- `pipe`: a `multiprocessing.Pipe` (`send_bytes`/`recv_bytes`), its reader woken by
  `anyio.wait_readable` on the connection, then drained while `poll()` says more is there.

Messages (`flowllm/messages.py`): `StepTokens` of 1, 64 and 256 sampled tokens, a
`TokenizedRequest` of 128 prompt tokens and a `TextDeltas` of 64 chunks. Every send
encodes and every receive decodes into the struct's type, as a channel would.

- one-way: the sender sends `--messages` messages (after a warm-up) as fast as it can;
  the receiver times them from the first after the warm-up to the last: messages/s and
  MB/s of encoded payload, and each side's CPU µs per message.
- ping-pong: one side sends a message, the other decodes it and sends its bytes back;
  `--pings` round trips after a warm-up: p50 and p99 in µs.

Each figure is the median of `--repeats` pairs.

    .venv/bin/python benchmarks/channel_transport.py                  # needs pyzmq for zmq
    .venv/bin/python benchmarks/channel_transport.py --messages 2000 --pings 200 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import anyio
import msgspec

from flowllm.messages import (
    Chunk,
    SampledTokens,
    SamplingParams,
    StepTokens,
    TextDeltas,
    TokenizedRequest,
)

TRANSPORTS = ("unix", "unix-buffered", "zmq", "pipe")
LENGTH_BYTES = 4
READ_SIZE = 1 << 16
WARMUP_FRACTION = 10  # one warm-up message or ping for every this many timed ones


def step_tokens(n: int) -> StepTokens:
    return StepTokens(
        step_id=1234,
        sampled=SampledTokens(
            seq_ids=tuple(range(n)), token_ids=tuple(1000 + 37 * i for i in range(n))
        ),
    )


def tokenized_request(prompt_len: int = 128) -> TokenizedRequest:
    return TokenizedRequest(
        request_id="cmpl-" + "0123456789abcdef" * 2,
        prompt_token_ids=tuple(1000 + 7 * i for i in range(prompt_len)),
        params=SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True),
        eos_token_ids=(50256,),
        arrival_time=12345.678,
    )


def text_deltas(n: int = 64) -> TextDeltas:
    return TextDeltas(
        step_id=1234,
        chunks=tuple(
            Chunk(
                request_id=f"cmpl-{i:032x}",
                index=0,
                text=" word",
                token_ids=(1000 + i,),
                num_output_tokens=17,
            )
            for i in range(n)
        ),
    )


# name -> (builder, the type the receiver decodes into)
MESSAGES: dict[str, tuple[Callable[[], msgspec.Struct], type[msgspec.Struct]]] = {
    "StepTokens x1": (lambda: step_tokens(1), StepTokens),
    "StepTokens x64": (lambda: step_tokens(64), StepTokens),
    "StepTokens x256": (lambda: step_tokens(256), StepTokens),
    "TokenizedRequest 128": (tokenized_request, TokenizedRequest),
    "TextDeltas x64": (text_deltas, TextDeltas),
}


class Endpoint(Protocol):
    """One side of a transport: whole messages in and out."""

    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes: ...

    async def aclose(self) -> None: ...


class UnixFramed:
    """Length-prefixed frames on an anyio byte stream, split out of whatever was read."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.frames: deque[bytes] = deque()

    async def send(self, data: bytes) -> None:
        await self.stream.send(len(data).to_bytes(LENGTH_BYTES, "little") + data)

    async def recv(self) -> bytes:
        while not self.frames:
            self.buffer += await self.stream.receive(READ_SIZE)
            buf, pos, end = self.buffer, 0, len(self.buffer)
            while end - pos >= LENGTH_BYTES:
                size = int.from_bytes(buf[pos : pos + LENGTH_BYTES], "little")
                if end - pos - LENGTH_BYTES < size:
                    break
                pos += LENGTH_BYTES
                self.frames.append(bytes(buf[pos : pos + size]))
                pos += size
            del buf[:pos]
        return self.frames.popleft()

    async def aclose(self) -> None:
        await self.stream.aclose()


class UnixBuffered:
    """Length-prefixed frames read with anyio's BufferedByteReceiveStream."""

    def __init__(self, stream: Any) -> None:
        from anyio.streams.buffered import BufferedByteReceiveStream

        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    async def send(self, data: bytes) -> None:
        await self.stream.send(len(data).to_bytes(LENGTH_BYTES, "little") + data)

    async def recv(self) -> bytes:
        size = int.from_bytes(await self.reader.receive_exactly(LENGTH_BYTES), "little")
        return await self.reader.receive_exactly(size)

    async def aclose(self) -> None:
        await self.stream.aclose()


class ZmqEndpoint:
    """A zmq.asyncio socket; ZeroMQ keeps message boundaries."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket

    async def send(self, data: bytes) -> None:
        await self.socket.send(data)

    async def recv(self) -> bytes:
        data: bytes = await self.socket.recv()
        return data

    async def aclose(self) -> None:
        self.socket.close(linger=1000)


class PipeEndpoint:
    """A multiprocessing Connection; the reader waits on the event loop, not in recv."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def send(self, data: bytes) -> None:
        self.conn.send_bytes(data)  # blocks only when the pipe is full

    async def recv(self) -> bytes:
        while not self.conn.poll():
            await anyio.wait_readable(self.conn.fileno())
        return self.conn.recv_bytes()

    async def aclose(self) -> None:
        self.conn.close()


async def open_endpoint(job: dict[str, Any], ready: Any) -> tuple[Endpoint, Callable[[], Any]]:
    """(this side's endpoint, a cleanup). The "server" side listens or binds, then sets
    `ready`; the "client" side waits for `ready`, then connects."""
    transport, side, address = job["transport"], job["side"], job["address"]
    if side == "client":
        await anyio.to_thread.run_sync(ready.wait)
    if transport in ("unix", "unix-buffered"):
        wrap = UnixFramed if transport == "unix" else UnixBuffered
        if side == "client":
            return wrap(await anyio.connect_unix(address)), lambda: None
        listener = await anyio.create_unix_listener(address)
        ready.set()
        stream = await listener.accept()
        await listener.aclose()
        return wrap(stream), lambda: None
    if transport == "zmq":
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context()
        one_way = zmq.PULL if side == "server" else zmq.PUSH
        kind = zmq.PAIR if job["mode"] == "latency" else one_way
        socket = context.socket(kind)
        if side == "client":
            socket.connect(f"ipc://{address}")
        else:
            socket.bind(f"ipc://{address}")
            ready.set()
        return ZmqEndpoint(socket), context.term
    if transport == "pipe":
        if side == "server":
            ready.set()
        return PipeEndpoint(job["conn"]), lambda: None
    raise ValueError(f"unknown transport {transport!r}")


async def run_side(job: dict[str, Any], ready: Any, done: Any) -> dict[str, Any]:
    """One process's part of one measurement; returns its figures."""
    build, kind = MESSAGES[job["message"]]
    message = build()
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(kind).decode
    count, warmup, side, mode = job["count"], job["warmup"], job["side"], job["mode"]
    endpoint, cleanup = await open_endpoint(job, ready)
    out: dict[str, Any] = {"bytes": len(encode(message))}
    if mode == "throughput":
        if side == "client":  # the sender
            c0 = time.process_time()
            for i in range(warmup + count):
                if i == warmup:
                    c0 = time.process_time()
                await endpoint.send(encode(message))
            out["cpu_us"] = (time.process_time() - c0) / count * 1e6
            await anyio.to_thread.run_sync(done.wait)  # every message is in before closing
        else:  # the receiver
            for _ in range(warmup):
                decode(await endpoint.recv())
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(count):
                decode(await endpoint.recv())
            out["seconds"] = time.perf_counter() - t0
            out["cpu_us"] = (time.process_time() - c0) / count * 1e6
            done.set()
    else:
        if side == "client":  # the pinger
            rtts: list[float] = []
            for i in range(warmup + count):
                t0 = time.perf_counter()
                await endpoint.send(encode(message))
                decode(await endpoint.recv())
                if i >= warmup:
                    rtts.append(time.perf_counter() - t0)
            rtts.sort()
            out["p50_us"] = rtts[len(rtts) // 2] * 1e6
            out["p99_us"] = rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))] * 1e6
            done.set()
        else:  # the ponger
            for _ in range(warmup + count):
                data = await endpoint.recv()
                decode(data)
                await endpoint.send(data)
            await anyio.to_thread.run_sync(done.wait)
    await endpoint.aclose()
    cleanup()
    return out


def side_main(job: dict[str, Any], ready: Any, done: Any, results: Any) -> None:
    """A spawned process: run one side and put its figures on the results queue."""
    try:
        out = anyio.run(run_side, job, ready, done)
    except BaseException as exc:  # reported to the parent, which fails the measurement
        out = {"error": f"{type(exc).__name__}: {exc}"}
    results.put((job["side"], out))


def measure(transport: str, message: str, mode: str, count: int, timeout: float) -> dict[str, Any]:
    """One measurement in a fresh pair of processes: the merged figures of both sides."""
    ctx = mp.get_context("spawn")
    ready, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="chan-") as tmp:
        address = str(Path(tmp) / "sock")
        base = {
            "transport": transport,
            "message": message,
            "mode": mode,
            "count": count,
            "warmup": max(1, count // WARMUP_FRACTION),
            "address": address,
        }
        jobs = [{**base, "side": "server"}, {**base, "side": "client"}]
        if transport == "pipe":
            duplex = mode == "latency"
            left, right = ctx.Pipe(duplex=duplex)  # left receives when one-way
            jobs[0]["conn"], jobs[1]["conn"] = left, right
        processes = [
            ctx.Process(target=side_main, args=(job, ready, done, results)) for job in jobs
        ]
        for p in processes:
            p.start()
        figures: dict[str, dict[str, Any]] = {}
        try:
            for _ in processes:
                side, out = results.get(timeout=timeout)
                figures[side] = out
        finally:
            for p in processes:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = [f"{s}: {f['error']}" for s, f in figures.items() if "error" in f]
    if errors:
        raise RuntimeError(f"{transport} {message} {mode}: " + "; ".join(errors))
    server, client = figures["server"], figures["client"]
    if mode == "throughput":
        rate = count / server["seconds"]
        return {
            "bytes": server["bytes"],
            "msgs_per_s": rate,
            "mb_per_s": rate * server["bytes"] / 1e6,
            "sender_cpu_us": client["cpu_us"],
            "receiver_cpu_us": server["cpu_us"],
        }
    return {"bytes": client["bytes"], "p50_us": client["p50_us"], "p99_us": client["p99_us"]}


def codec_cost(number: int = 2000, repeats: int = 3) -> dict[str, tuple[int, float, float]]:
    """Per message: (encoded bytes, encode µs, decode µs), in this process, the best of
    `repeats` loops of `number` (the least disturbed by other work)."""

    def per_call(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            best = min(best, time.perf_counter() - t0)
        return best / number * 1e6

    out = {}
    for name, (build, kind) in MESSAGES.items():
        message = build()
        encode = msgspec.msgpack.Encoder().encode
        decode = msgspec.msgpack.Decoder(kind).decode
        data = encode(message)
        out[name] = (len(data), per_call(partial(encode, message)), per_call(partial(decode, data)))
    return out


def names(text: str, allowed: tuple[str, ...] | list[str], what: str) -> list[str]:
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{what}: choose from {', '.join(allowed)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--transports",
        type=lambda t: names(t, TRANSPORTS, "--transports"),
        default=list(TRANSPORTS),
        help="comma-separated (default: all; zmq needs pyzmq)",
    )
    parser.add_argument(
        "--message-kinds",
        type=lambda t: names(t, list(MESSAGES), "--message-kinds"),
        default=list(MESSAGES),
        help="comma-separated message names (default: all)",
    )
    parser.add_argument("--messages", type=int, default=20000, help="one-way, timed")
    parser.add_argument("--pings", type=int, default=2000, help="round trips, timed")
    parser.add_argument("--repeats", type=int, default=3, help="pairs per figure (median)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per pair")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if min(args.messages, args.pings, args.repeats) < 1:
        parser.error("--messages, --pings and --repeats must be >= 1")
    if "zmq" in args.transports:
        try:
            import zmq

            print(f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}")
        except ImportError:
            print("pyzmq is not installed: zmq skipped (pip install pyzmq)")
            args.transports.remove("zmq")
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    codec = codec_cost()
    rows: list[dict[str, Any]] = []
    for message in args.message_kinds:
        for transport in args.transports:
            runs: dict[str, list[dict[str, Any]]] = {"throughput": [], "latency": []}
            for _ in range(args.repeats):  # the two modes alternate, so load drifts hit both
                for mode, count in (("throughput", args.messages), ("latency", args.pings)):
                    runs[mode].append(measure(transport, message, mode, count, args.timeout))
            row: dict[str, Any] = {"message": message, "transport": transport}
            row["bytes"] = runs["throughput"][0]["bytes"]
            for figures in runs.values():
                for key in figures[0]:
                    if key != "bytes":
                        row[key] = statistics.median(f[key] for f in figures)
            rows.append(row)
            print(
                f"{message:>20} {transport:>13}: {row['msgs_per_s']:9,.0f} msg/s "
                f"{row['mb_per_s']:7.1f} MB/s  send {row['sender_cpu_us']:5.1f} "
                f"recv {row['receiver_cpu_us']:5.1f} CPU µs/msg  "
                f"RTT p50 {row['p50_us']:6.1f} p99 {row['p99_us']:7.1f} µs",
                flush=True,
            )
    load_end = os.getloadavg()
    print("\n| message | bytes | encode µs | decode µs |\n|---|---:|---:|---:|")
    for name, (size, enc, dec) in codec.items():
        print(f"| {name} | {size:,} | {enc:.1f} | {dec:.1f} |")
    print()
    print("| message | bytes | encode + decode µs | transport | msg/s | MB/s | "
          "send CPU µs | recv CPU µs | RTT p50 µs | RTT p99 µs |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        size, enc, dec = codec[row["message"]]
        print(
            f"| {row['message']} | {size:,} | {enc + dec:.1f} | {row['transport']} | "
            f"{row['msgs_per_s']:,.0f} | {row['mb_per_s']:.1f} | {row['sender_cpu_us']:.1f} | "
            f"{row['receiver_cpu_us']:.1f} | {row['p50_us']:.1f} | {row['p99_us']:.1f} |"
        )
    print(f"\nload average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "argv": sys.argv,
                    "load_avg_start": load,
                    "load_avg_end": load_end,
                    "codec": {k: dict(zip(("bytes", "encode_us", "decode_us"), v, strict=True))
                              for k, v in codec.items()},
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
