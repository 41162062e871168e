"""The offline API on a reasoning model that thinks by script (model_fixtures'
THINKING_MODEL, as the e2e reasoning server's): template variables, and a constraint
after the thinking part."""

from __future__ import annotations

import msgspec
import pytest
from model_fixtures import QWEN3_STYLE_TEMPLATE, THINKING_MODEL, build_next_token_qwen3_dir

from flowllm import LLM, SamplingParams, StructuredOutputs
from flowllm.mailbox import RequestFailed
from flowllm.text.reasoning import ReasoningParser

QUESTION = [{"role": "user", "content": "Is it?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = build_next_token_qwen3_dir(
        tmp_path_factory.mktemp("thinking-qwen3"),
        THINKING_MODEL,
        added_tokens=("<think>", "</think>"),
        chat_template=QWEN3_STYLE_TEMPLATE,
    )
    return LLM(str(model), dtype="float32", max_model_len=256, kv_cache_memory=1 << 24)


def test_template_kwargs_turn_thinking_off(llm: LLM) -> None:
    (thinks,) = llm.chat(QUESTION, GREEDY)
    assert thinks.outputs[0].text == "<think> I think</think>\n\n Yes."
    (answers,) = llm.chat(QUESTION, GREEDY, chat_template_kwargs={"enable_thinking": False})
    assert answers.outputs[0].text == " Yes."
    with pytest.raises(RequestFailed) as raised:
        llm.chat(QUESTION, GREEDY, chat_template_kwargs={"messages": []})
    assert raised.value.error.param == "chat_template_kwargs"


def test_a_constraint_after_the_thinking_part(llm: LLM) -> None:
    tags = ReasoningParser.named("qwen3").tokens(llm.tokenizer)
    assert tags is not None
    regex = StructuredOutputs(regex=" No!")
    after = msgspec.structs.replace(regex, after_reasoning=tags)
    (free, from_the_start) = llm.chat(
        [QUESTION, QUESTION],
        [
            msgspec.structs.replace(GREEDY, structured_outputs=after),
            msgspec.structs.replace(GREEDY, structured_outputs=regex),
        ],
    )
    assert free.outputs[0].text == "<think> I think</think> No!"
    assert from_the_start.outputs[0].text == " No!"
