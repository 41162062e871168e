"""The page in headless Chromium: a streamed chat, the sampling parameters, logprobs on
hover, copy as curl / Python (run for real), the graph view under load, the request
timeline, and the API key. Every page's console must stay free of errors (conftest)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import API_KEY
from playwright.sync_api import expect
from server_process import REPO, ServerProcess
from ui_helpers import screenshot

from flowllm.traces.timeline import write_chrome_trace
from flowllm.traces.trace import load_trace


def open_page(page: Any, server: ServerProcess) -> None:
    page.goto(server.url + "/")
    expect(page.locator("body")).to_have_attribute("data-ready", "true")


def chat(page: Any, text: str, *, temperature: str, seed: str, max_tokens: str = "12") -> Any:
    """Send `text` from the playground; returns the request body the page posted."""
    page.fill("#temperature", temperature)
    page.fill("#seed", seed)
    page.fill("#max_tokens", max_tokens)
    page.fill("#prompt", text)
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    expect(page.locator("#stats")).to_contain_text("tokens/s")
    return sent.value.post_data_json


def sdk_answer(server: ServerProcess, body: dict[str, Any]) -> Any:
    """The same request through the openai SDK, not streamed: the oracle."""
    extra = {"top_k": body["top_k"]}
    args = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "top_k")}
    return server.client().chat.completions.create(**args, extra_body=extra)


def test_chat_streams_and_follows_the_parameters(page: Any, ui_server: ServerProcess) -> None:
    page, _ = page
    open_page(page, ui_server)
    # Count the answer's DOM updates: a streamed answer arrives in several.
    page.evaluate(
        """() => { window.updates = 0; new MutationObserver(() => window.updates++)
        .observe(document.getElementById('answer'), {childList: true}); }"""
    )
    body = chat(page, "Tell me a story", temperature="0.9", seed="7", max_tokens="16")
    assert body["stream"] is True and body["temperature"] == 0.9 and body["seed"] == 7
    assert body["max_tokens"] == 16 and body["top_p"] == 1 and body["top_k"] == 0
    assert body["logprobs"] is True and body["top_logprobs"] == 5
    assert page.evaluate("window.updates") >= 8
    oracle = sdk_answer(ui_server, body)
    assert page.inner_text("#answer") == oracle.choices[0].message.content
    stats = page.inner_text("#stats")
    assert "TTFT" in stats and f"{oracle.usage.completion_tokens} tokens" in stats
    assert float(page.get_attribute("#stats", "data-ttft")) > 0
    assert float(page.get_attribute("#stats", "data-tokens-per-s")) > 0

    # A lower temperature, top_p, top_k and a stop string reach the request and the answer.
    page.fill("#top_p", "0.8")
    page.fill("#top_k", "20")
    page.fill("#stop-strings", "zzz-never")
    body = chat(page, "And another", temperature="0", seed="3")
    assert body["temperature"] == 0 and body["top_p"] == 0.8 and body["top_k"] == 20
    assert body["stop"] == ["zzz-never"]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    oracle = sdk_answer(ui_server, body)
    assert page.inner_text("#answer") == oracle.choices[0].message.content

    # Hovering a token shows its logprob and the alternatives the server sent.
    page.hover("#answer .tok >> nth=1")
    tip = page.locator("#token-tip")
    expect(tip).to_be_visible()
    token = oracle.choices[0].logprobs.content[1]
    chosen = tip.locator("tr.chosen td").all_inner_texts()
    assert chosen[0] == json.dumps(token.token) and float(chosen[1]) == round(token.logprob, 3)
    shown = {json.loads(t) for t in tip.locator("tr td:first-child").all_inner_texts()[1:]}
    assert {alt.token for alt in token.top_logprobs} <= shown
    screenshot(page, "playground")


def test_tokens_the_answer_does_not_show(page: Any, ui_server: ServerProcess) -> None:
    """The end-of-sequence token has a logprob but no text in the answer: it is marked,
    and the answer's text stays the server's text."""
    page, _ = page
    open_page(page, ui_server)
    cut = page.evaluate(
        """() => pieces("Hello world", [{text: "Hello", logprob: -1}, {text: " world",
        logprob: -2}, {text: "<|im_end|>", logprob: -0.5}])"""
    )
    assert [p["text"] for p in cut] == ["Hello", " world", ""]
    assert cut[2]["special"] == "<|im_end|>" and cut[2]["logprob"] == -0.5
    # Text no token accounts for (a character split over byte tokens) is kept as it is.
    cut = page.evaluate("""() => pieces("é!", [{text: "bytes:\\xc3", logprob: -1}])""")
    assert "".join(p["text"] for p in cut) == "é!"


def run_snippet(args: list[str], text: str) -> str:
    result = subprocess.run(args, input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_copy_as_curl_and_python_run_the_same_request(page: Any, ui_server: ServerProcess) -> None:
    page, _ = page
    open_page(page, ui_server)
    page.check("#mode-completion")
    page.fill("#prompt", "The weather today is")
    page.fill("#temperature", "0.8")
    page.fill("#seed", "11")
    page.fill("#max_tokens", "10")
    page.click("#send")
    expect(page.locator("#stats")).to_contain_text("tokens/s")
    answer = page.inner_text("#answer")
    page.click("#copy-curl")
    curl = page.inner_text("#snippet")
    assert curl.startswith("curl -sN " + ui_server.url + "/v1/completions")
    events = [
        json.loads(line[6:])
        for line in run_snippet(["bash"], curl).splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(c["text"] for e in events for c in e["choices"]) == answer
    page.click("#copy-python")
    python = page.inner_text("#snippet")
    assert "from openai import OpenAI" in python
    assert run_snippet([sys.executable, "-"], python) == answer + "\n"


def test_graph_view_moves_under_load(page: Any, ui_server: ServerProcess) -> None:
    page, _ = page
    open_page(page, ui_server)
    page.click("#tab-graph")
    shape = httpx.get(f"{ui_server.url}/ui/graph").json()  # the running graph's YAML
    boxes = page.locator("#graph-canvas svg g[data-stage]")
    expect(boxes).to_have_count(len(shape["stages"]))
    assert page.locator("#graph-canvas svg path.edge").count() == len(shape["edges"])
    execute = page.locator('#stage-table tr[data-stage="execute"] td[data-key="messages"]')
    expect(execute).not_to_have_text("–")
    before = int(execute.inner_text())
    client = ui_server.client()
    done = threading.Event()

    def load() -> None:
        while not done.is_set():
            client.completions.create(
                model=ui_server.model, prompt="Once", max_tokens=48, extra_body={"ignore_eos": True}
            )

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        rate = page.locator('#stage-table tr[data-stage="execute"] td[data-key="rate"]')
        expect(rate).not_to_have_text("0.0")
        expect(rate).not_to_have_text("–")
        expect(page.locator("#eng-tps")).not_to_have_text("0.0 tok/s")
        busy = page.locator('#stage-table tr[data-stage="execute"] td[data-key="busy"]')
        expect(busy).not_to_have_text("0%")
        page.wait_for_timeout(1500)
        screenshot(page, "graph-under-load")
        assert int(execute.inner_text()) > before
        label = page.locator('#graph-canvas text[data-channel="execute.in"]')
        assert (label.text_content() or "").endswith("/2")
    finally:
        done.set()
        for t in threads:
            t.join()


def test_request_timeline(page: Any, ui_server: ServerProcess, tmp_path: Path) -> None:
    page, _ = page
    open_page(page, ui_server)
    chat(page, "Hi", temperature="0", seed="1", max_tokens="5")
    page.click("#tab-timeline")
    expect(page.locator("#timeline-request option")).not_to_have_count(0)
    selected = page.eval_on_selector("#timeline-request", "s => s.value")
    assert selected.startswith("chatcmpl-")
    lanes = page.locator("#timeline .lane")
    stages = httpx.get(f"{ui_server.url}/ui/graph").json()["stages"]
    expect(lanes).to_have_count(len(stages))  # every stage handled the request or its steps
    assert page.locator('#timeline .lane[data-stage="execute"] .span:not(.wait)').count() == 5
    assert page.locator('#timeline .lane[data-stage="deliver"] .span:not(.wait)').count() >= 1
    screenshot(page, "timeline")
    # A file `flowllm trace view -o` wrote: the same view, its requests to choose from.
    exported = write_chrome_trace(load_trace(REPO / "traces" / "greedy"), tmp_path / "t.json")
    page.set_input_files("#trace-file", str(exported))
    expect(page.locator("#timeline-request option")).to_have_count(2)
    expect(page.locator("#timeline-summary")).to_contain_text("spans over")
    assert page.locator('#timeline .lane[data-stage="execute"] .span:not(.wait)').count() >= 1


def test_the_page_asks_for_the_api_key(page: Any, ui_auth_server: ServerProcess) -> None:
    page, _ = page
    page.goto(ui_auth_server.url + "/")
    expect(page.locator("#key-dialog")).to_be_visible()
    page.fill("#api-key", API_KEY)
    page.click("#key-save")
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(page.locator("#feed-state")).to_have_class("feed-state on")
    body = chat(page, "Hello", temperature="0", seed="2", max_tokens="4")
    assert body["model"] == ui_auth_server.model
    assert page.inner_text("#answer")


def test_stop_aborts_the_answer(page: Any, ui_server: ServerProcess) -> None:
    page, _ = page
    open_page(page, ui_server)
    page.fill("#max_tokens", "400")
    page.fill("#prompt", "Go on and on")
    page.click("#send")
    expect(page.locator("#answer .tok").nth(2)).to_be_attached()
    page.click("#stop")
    expect(page.locator("#send")).to_be_enabled()
    shown = page.locator("#answer .tok").count()
    assert shown < 400
    # The server aborted the request: nothing runs any more and the answer stays as it is.
    expect(page.locator("#eng-running")).to_have_text("0")
    page.wait_for_timeout(500)
    assert page.locator("#answer .tok").count() == shown
    assert page.inner_text("#error") == ""
