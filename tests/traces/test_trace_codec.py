"""Trace encoding: tensors explicit and exact, every message type round-trips, framing and
schema versions are checked."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from flowllm import messages as M
from flowllm.traces.codec import (
    MessageCodec,
    TensorDigest,
    decode_tensor,
    encode_tensor,
    iter_frames,
    read_channel,
)
from flowllm.traces.manifest import SCHEMA_VERSION, TraceSchemaError, read_manifest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 7, generator=torch.Generator().manual_seed(0)),
        torch.randn(2, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        torch.randn(4, generator=torch.Generator().manual_seed(2)).to(torch.float16),
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.empty(0, 50257),
    ],
    ids=["float32", "bfloat16", "float16", "int64", "empty"],
)
def test_tensor_round_trip_is_bit_exact(tensor: torch.Tensor) -> None:
    back = decode_tensor(encode_tensor(tensor))
    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_tensor_bytes_are_little_endian_raw_data() -> None:
    t = torch.tensor([1.0, -2.5], dtype=torch.float32)
    header = msgspec.msgpack.decode(encode_tensor(t))
    assert header[0] == "float32"
    assert header[1] == [2]
    assert header[2] == t.numpy().astype("<f4").tobytes()


def test_digest_keeps_top_k_and_moments() -> None:
    t = torch.randn(2, 100, generator=torch.Generator().manual_seed(3))
    d = TensorDigest.of(t, 4)
    top = torch.topk(t.double(), 4, dim=1)
    assert d.shape == (2, 100)
    assert d.indices == top.indices.tolist()
    assert [v for row in d.values for v in row] == pytest.approx(top.values.flatten().tolist())
    assert d.sums == pytest.approx(t.double().sum(1).tolist())
    assert d.sumsqs == pytest.approx((t.double() ** 2).sum(1).tolist())


def _messages() -> list[object]:
    params = M.SamplingParams(n=2, temperature=0.5, stop=("x",), logit_bias={5: 1.5}, seed=3)
    request = M.GenerateRequest(
        request_id="r", model="m", params=params, arrival_time=1.5, prompt="hi"
    )
    start = M.SeqStart(
        seq_id=0,
        request_id="r",
        index=0,
        params=params,
        prompt_token_ids=(1, 2),
        eos_token_ids=(9,),
    )
    batch = M.StepBatch(
        step_id=4,
        rows=M.ScheduledRows.of(
            (
                M.ScheduledSeq(
                    seq_id=0,
                    token_ids=(1, 2),
                    num_computed_tokens=0,
                    block_table=(3,),
                    sample=True,
                    num_output_tokens=0,
                ),
            )
        ),
        started=(start,),
        released=(7,),
        prompt_logits_for=(0,),
    )
    lp = M.TokenLogprobs(5, -0.25, 1, ((5, -0.25), (6, -1.0)))
    chunk = M.Chunk(request_id="r", index=1, text="é", token_ids=(5,), logprobs=(lp,))
    return [
        request,
        M.ValidRequest(request),
        M.TokenizedRequest(
            request_id="r",
            prompt_token_ids=(1, 2),
            params=params,
            eos_token_ids=(9,),
            arrival_time=2.0,
        ),
        M.Abort("r"),
        M.Finish(0, "x"),
        M.RequestError(request_id="r", message="no", param="top_p"),
        batch,
        M.StepTokens(
            step_id=4,
            sampled=M.SampledTokens.of(
                (M.SampledToken(seq_id=0, token_id=5, logprobs=lp, finish_reason="stop"),)
            ),
            prompt_logprobs={0: (None, lp)},
        ),
        M.ChoiceEvents(
            step_id=4,
            started=(M.ChoiceStart(seq=start, prompt_text="hi", scheduled_time=3.5),),
            ended=(7,),
        ),
        M.TextDeltas(step_id=4, chunks=(chunk,)),
    ]


@pytest.mark.parametrize("message", _messages(), ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(message: object) -> None:
    codec = MessageCodec()
    frame = codec.encode(message, 12.5, 77)
    (body,) = iter_frames_from(frame)
    entry = codec.decode(body)
    assert entry.message == message
    assert type(entry.message) is type(message)
    assert entry.send_time == 12.5
    assert entry.object_id == 77


def iter_frames_from(data: bytes) -> list[memoryview]:
    """The frames of `data`, read back through a file as a trace reader does."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.msgpack"
        path.write_bytes(data)
        return [memoryview(bytes(f)) for f in iter_frames(path)]


def test_step_logits_tensors_full_and_digest(tmp_path: Path) -> None:
    batch = _messages()[6]
    logits = torch.randn(1, 2000, generator=torch.Generator().manual_seed(4))
    prompt = torch.randn(2, 2000, generator=torch.Generator().manual_seed(5))
    message = M.StepLogits(batch=batch, logits=logits, prompt_logits={0: prompt})
    full = MessageCodec().decode(iter_frames_from(MessageCodec().encode(message, 0.0))[0])
    assert torch.equal(full.message.logits, logits)
    assert torch.equal(full.message.prompt_logits[0], prompt)
    assert full.message.batch == batch
    digest = MessageCodec(digest_k=3).encode(message, 0.0)
    assert len(digest) < len(MessageCodec().encode(message, 0.0)) / 3
    back = MessageCodec().decode(iter_frames_from(digest)[0]).message
    assert isinstance(back.logits, TensorDigest)
    assert back.logits.indices[0] == torch.topk(logits[0], 3).indices.tolist()


def test_a_truncated_last_frame_is_ignored(tmp_path: Path) -> None:
    codec = MessageCodec()
    data = codec.encode(M.Abort("a"), 1.0) + codec.encode(M.Abort("b"), 2.0)
    path = tmp_path / "x.msgpack"
    path.write_bytes(data[:-3])
    assert [e.message for e in read_channel(path)] == [M.Abort("a")]


def test_committed_traces_have_this_schema_version() -> None:
    traces = [d for d in (REPO / "traces").iterdir() if d.is_dir()]
    assert traces
    for d in traces:
        assert read_manifest(d).schema_version == SCHEMA_VERSION


def test_another_schema_version_is_refused_clearly(tmp_path: Path) -> None:
    data = json.loads((REPO / "traces" / "greedy" / "manifest.json").read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(
        TraceSchemaError,
        match=rf"schema version {SCHEMA_VERSION + 1}.*"
        rf"reads schema version {SCHEMA_VERSION} only",
    ):
        read_manifest(tmp_path)
    with pytest.raises(TraceSchemaError, match="not a flowllm trace"):
        read_manifest(tmp_path / "nowhere")
