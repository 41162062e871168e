"""Grammar compilation, its cache, the bitmask, and the sampler under masks (GPT-2 tokenizer)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from flowllm.config import engine_config
from flowllm.engine.loading import build_services
from flowllm.messages import (
    ReasoningTokens,
    SamplingParams,
    ScheduledRows,
    ScheduledSeq,
    SeqStart,
    StepBatch,
    StructuredOutputs,
)
from flowllm.sampling.grammar import GrammarError, Grammars
from flowllm.sampling.logits_processors import apply_bitmask
from flowllm.sampling.sampler import Sampler
from flowllm.stages.guide import Guide, GuideError
from flowllm.stages.services import EngineServices

VOCAB = 50257
EOS = 50256


@pytest.fixture(scope="module")
def grammars(gpt2_tokenizer: Any) -> Grammars:
    return Grammars(gpt2_tokenizer, VOCAB, (EOS,))


def allowed(grammars: Grammars, matcher: Any) -> set[int]:
    bitmask = grammars.allocate_bitmask(1)
    matcher.fill(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, bitmask, [0])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def walk(grammars: Grammars, tokenizer: Any, spec: StructuredOutputs, text: str) -> set[int]:
    """Feed `text`'s tokens to a fresh matcher; the tokens allowed after them."""
    matcher = grammars.matcher(spec)
    for token in tokenizer.encode(text):
        assert matcher.accept(token), (text, token)
    return allowed(grammars, matcher)


def test_a_compiled_grammar_is_cached_by_its_constraint(grammars: Grammars) -> None:
    a = grammars.compile(StructuredOutputs(regex="[0-9]+", param="guided_regex"))
    b = grammars.compile(StructuredOutputs(regex="[0-9]+"))  # where it came from is no key
    c = grammars.compile(StructuredOutputs(regex="[0-9]+x"))
    assert a is b and a is not c
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    as_dict = grammars.compile(StructuredOutputs(json=schema))
    spelled = '{"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}'
    as_text = grammars.compile(StructuredOutputs(json=spelled))
    assert as_dict is as_text  # the same schema, however it was spelled


def test_the_cache_is_bounded(gpt2_tokenizer: Any) -> None:
    grammars = Grammars(gpt2_tokenizer, VOCAB, (EOS,), cache_entries=2)
    first = grammars.compile(StructuredOutputs(regex="a"))
    grammars.compile(StructuredOutputs(regex="b"))
    grammars.compile(StructuredOutputs(regex="c"))
    assert len(grammars._cache) == 2
    assert grammars.compile(StructuredOutputs(regex="a")) is not first  # evicted, compiled anew


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        (StructuredOutputs(json={"type": "frobnicate"}, param="guided_json"), "JSON schema"),
        (StructuredOutputs(regex="[a-", param="guided_regex"), "regex"),
        (StructuredOutputs(grammar="root ::= missing", param="guided_grammar"), "grammar"),
        (StructuredOutputs(json="{not json", param="structured_outputs"), "JSON schema"),
    ],
)
def test_invalid_constraints_name_their_field(
    grammars: Grammars, spec: StructuredOutputs, what: str
) -> None:
    with pytest.raises(GrammarError) as raised:
        grammars.compile(spec)
    assert raised.value.param == spec.param
    assert raised.value.message.startswith(f"Invalid {what} in '{spec.param}': ")
    assert "/project/" not in raised.value.message and ".cc:" not in raised.value.message


def test_regex_choice_and_gbnf_allow_what_they_accept(
    grammars: Grammars, gpt2_tokenizer: Any
) -> None:
    regex = StructuredOutputs(regex="[a-z]{3}-[0-9]{2}")
    after = walk(grammars, gpt2_tokenizer, regex, "abc-1")
    assert after and all(re.fullmatch("[0-9]", gpt2_tokenizer.decode([t])) for t in after)
    assert walk(grammars, gpt2_tokenizer, regex, "abc-12") == {EOS}  # complete: only EOS
    choice = StructuredOutputs(choice=("yes", 'a "quoted" no'))
    assert walk(grammars, gpt2_tokenizer, choice, 'a "quoted" no') == {EOS}
    gbnf = StructuredOutputs(grammar='root ::= num ("+" num)*\nnum ::= [0-9]+')
    after = walk(grammars, gpt2_tokenizer, gbnf, "12+3")
    assert EOS in after and gpt2_tokenizer.encode("+")[0] in after
    assert gpt2_tokenizer.encode("-")[0] not in after


def test_apply_bitmask_touches_only_the_given_rows(grammars: Grammars) -> None:
    bitmask = grammars.allocate_bitmask(2)
    bitmask.zero_()
    bitmask[0, 0] = 1 << 5  # row 0 allows token 5 only
    bitmask[1, 1] = 1 << 2  # row 1 allows token 34 only
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [1, 3])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.nonzero(torch.isfinite(logits[1])).flatten().tolist() == [5]
    assert torch.nonzero(torch.isfinite(logits[3])).flatten().tolist() == [34]


def start(seq_id: int, params: SamplingParams, prompt: tuple[int, ...] = (1, 2, 3)) -> SeqStart:
    return SeqStart(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        index=0,
        params=params,
        prompt_token_ids=prompt,
        eos_token_ids=(EOS,),
    )


def test_the_sampler_samples_and_reports_logprobs_under_the_mask(grammars: Grammars) -> None:
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, logprobs=2)
    sampler.start(start(0, params))
    sampler.start(start(1, params))
    logits = torch.randn(2, VOCAB)
    bitmask = grammars.allocate_bitmask(1)
    bitmask.zero_()
    bitmask[0, 0] = (1 << 7) | (1 << 9)  # row 1 may only be 7 or 9
    tokens = sampler.sample([0, 1], logits, [0, 0], ([1], bitmask))
    assert tokens[0].token_id == int(logits[0].argmax())  # the unconstrained row is free
    masked = torch.full((VOCAB,), float("-inf"))
    masked[[7, 9]] = logits[1, [7, 9]]
    oracle = torch.log_softmax(masked, dim=-1)
    lp = tokens[1].logprobs
    assert tokens[1].token_id == int(masked.argmax()) and lp is not None
    assert lp.logprob == pytest.approx(float(oracle[tokens[1].token_id]), abs=1e-5)
    assert lp.rank == 1
    assert {t for t, _ in lp.top} == {7, 9}  # the alternatives are allowed tokens
    # the model's logits are not written
    assert torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def services(gpt2_tiny_dir: Path) -> EngineServices:
    return build_services(
        engine_config(str(gpt2_tiny_dir), dtype="float32", kv_cache_memory=1 << 20)
    )


def row(seq_id: int, tokens: tuple[int, ...], computed: int, outputs: int) -> ScheduledSeq:
    return ScheduledSeq(
        seq_id=seq_id,
        token_ids=tokens,
        num_computed_tokens=computed,
        block_table=(0,),
        sample=True,
        num_output_tokens=outputs,
    )


def test_guide_follows_decodes_and_recompute(services: EngineServices, gpt2_tokenizer: Any) -> None:
    """The matcher accepts each output once: from a decode's token, or inside a recompute
    chunk after a preemption (only outputs it has not accepted yet)."""
    guide = Guide(None, services)
    spec = StructuredOutputs(regex="[0-9]{4}")
    digits = gpt2_tokenizer.encode("1")[0], gpt2_tokenizer.encode("2")[0]
    prompt = (10, 11, 12)
    batch = StepBatch(
        step_id=0,
        rows=ScheduledRows.of((row(0, prompt, 0, 0), row(1, prompt, 0, 0))),
        started=(start(0, SamplingParams(structured_outputs=spec), prompt),
                 start(1, SamplingParams(), prompt)),
    )  # fmt: skip
    masks = guide._fill(batch)
    assert masks.seq_ids == (0,)  # the unconstrained sequence has no row
    decode = StepBatch(
        step_id=1, rows=ScheduledRows.of((row(0, (digits[0],), 3, 1), row(1, (5,), 3, 1)))
    )
    guide._fill(decode)
    assert guide._seqs[0].num_accepted == 1
    # preempted, then recomputed from the start: prompt + "1" + "2" in one chunk
    recompute = StepBatch(
        step_id=2, rows=ScheduledRows.of((row(0, (*prompt, digits[0], digits[1]), 0, 2),))
    )
    guide._fill(recompute)
    assert guide._seqs[0].num_accepted == 2
    # a decode whose token the grammar forbids is a bug upstream, not a silent pass
    with pytest.raises(GuideError):
        guide._fill(
            StepBatch(
                step_id=3, rows=ScheduledRows.of((row(0, (gpt2_tokenizer.encode("x")[0],), 5, 3),))
            )
        )
    guide._fill(StepBatch(step_id=4, rows=ScheduledRows.of(()), released=(0, 1)))
    assert guide.live_sequences() == 0


def row_allowed(bitmask: torch.Tensor, i: int) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, bitmask[i : i + 1], [0])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_guide_masks_each_drafted_position_and_catches_up_on_accepted_drafts(
    services: EngineServices, grammars: Grammars, gpt2_tokenizer: Any
) -> None:
    """A row verifying d drafts gets d + 1 masks: each what the grammar allows after the
    drafts before it, the rows from a forbidden draft on repeating the last mask; the
    matcher is rolled back. Next step it accepts the drafts that were accepted (from the
    last row) and the token drawn after them (from this row)."""
    guide = Guide(None, services)
    spec = StructuredOutputs(regex="[0-9]{4}")
    one, two, three, five = (gpt2_tokenizer.encode(d)[0] for d in "1235")
    x = gpt2_tokenizer.encode("x")[0]
    prompt = (10, 11, 12)

    def after(*tokens: int) -> set[int]:
        matcher = grammars.matcher(spec)
        for token in tokens:
            assert matcher.accept(token)
        return allowed(grammars, matcher)

    started = (start(0, SamplingParams(structured_outputs=spec), prompt),)
    guide._fill(
        StepBatch(step_id=0, rows=ScheduledRows.of((row(0, prompt, 0, 0),)), started=started)
    )
    # "1" was sampled; the next step verifies the drafts "2", "x", "3"
    verify = msgspec.structs.replace(row(0, (one, two, x, three), 3, 1), num_draft_tokens=3)
    masks = guide._fill(StepBatch(step_id=1, rows=ScheduledRows.of((verify,))))
    assert masks.seq_ids == (0, 0, 0, 0)
    got = [row_allowed(masks.bitmask, i) for i in range(4)]
    assert got[0] == after(one) and got[1] == after(one, two) and got[0] != got[1]
    assert got[2] == got[1] and got[3] == got[1]  # "x" is forbidden: verification stops
    assert guide._seqs[0].num_accepted == 1 and allowed(grammars, guide._seqs[0].matcher) == got[0]
    # "2" was accepted, "5" drawn where "x" was rejected: the next row starts at "5"
    masks = guide._fill(StepBatch(step_id=2, rows=ScheduledRows.of((row(0, (five,), 5, 3),))))
    assert guide._seqs[0].num_accepted == 3
    assert masks.seq_ids == (0,) and row_allowed(masks.bitmask, 0) == after(one, two, five)
    # an output neither in this row nor among the last row's drafts is a bug upstream
    with pytest.raises(GuideError):
        guide._fill(StepBatch(step_id=3, rows=ScheduledRows.of((row(0, (three,), 9, 5),))))


def test_guide_leaves_the_thinking_part_free(
    services: EngineServices, grammars: Grammars, gpt2_tokenizer: Any
) -> None:
    """A constraint after a reasoning parser's thinking part, over a scripted token
    stream: qwen3's first token may open the thinking part (<think> is allowed besides
    the grammar's tokens), thinking tokens are free whatever the grammar says, and the
    grammar applies from the token after </think>. Here "<" and ">" play the tags."""
    guide = Guide(None, services)
    think, end = gpt2_tokenizer.encode("<")[0], gpt2_tokenizer.encode(">")[0]
    one, x = gpt2_tokenizer.encode("1")[0], gpt2_tokenizer.encode("x")[0]
    digits = StructuredOutputs(regex="[0-9]{4}")

    def after(opens_inside: bool) -> SamplingParams:
        tags = ReasoningTokens(start=think, end=end, opens_inside=opens_inside)
        constraint = msgspec.structs.replace(digits, after_reasoning=tags)
        return SamplingParams(structured_outputs=constraint)

    plain = allowed(grammars, grammars.matcher(digits))
    assert think not in plain and x not in plain
    prompt = (10, 11, 12)
    qwen3_thinks, qwen3_answers, r1 = 0, 1, 2
    batch = StepBatch(
        step_id=0,
        rows=ScheduledRows.of(tuple(row(s, prompt, 0, 0) for s in range(3))),
        started=(start(0, after(False), prompt), start(1, after(False), prompt),
                 start(2, after(True), prompt)),
    )  # fmt: skip
    masks = guide._fill(batch)
    assert masks.seq_ids == (qwen3_thinks, qwen3_answers)  # deepseek_r1 starts thinking
    assert row_allowed(masks.bitmask, 0) == row_allowed(masks.bitmask, 1) == plain | {think}

    def step(step_id: int, tokens: tuple[int, ...], outputs: int) -> StepBatch:
        seqs = tuple(row(s, (t,), 2 + outputs, outputs) for s, t in enumerate(tokens))
        return StepBatch(step_id=step_id, rows=ScheduledRows.of(seqs))

    masks = guide._fill(step(1, (think, one, x), 1))
    assert masks.seq_ids == (qwen3_answers,)  # the others think: free
    assert row_allowed(masks.bitmask, 0) == walk(grammars, gpt2_tokenizer, digits, "1")
    masks = guide._fill(step(2, (x, one, end), 2))
    assert masks.seq_ids == (qwen3_answers, r1)
    assert row_allowed(masks.bitmask, 1) == plain  # a fresh grammar, and no <think>
    masks = guide._fill(step(3, (end, one, one), 3))
    assert masks.seq_ids == (qwen3_thinks, qwen3_answers, r1)
    assert row_allowed(masks.bitmask, 0) == plain
    # deepseek_r1's "x", </think>, then "1", which its grammar accepted
    assert row_allowed(masks.bitmask, 2) == walk(grammars, gpt2_tokenizer, digits, "1")
    with pytest.raises(GuideError):  # after </think> the grammar holds
        guide._fill(step(4, (x, one, one), 4))


def test_serving_modules_leave_xgrammar_to_the_first_constrained_request() -> None:
    """xgrammar imports transformers: imported with the API, it held a server's start
    before the weights began to load (benchmarks/README.md, "Start-up")."""
    code = (
        "import sys\n"
        "import flowllm.api.app, flowllm.engine.async_engine, flowllm.server\n"
        "import flowllm.stages.services\n"
        "print('xgrammar' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
