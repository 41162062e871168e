"""Take the web page's screenshots in docs/images (`make ui-screenshots`).

Serves the bundled SmolLM2-135M-Instruct, asks the playground a question, then loads the
server with streamed requests while the graph view is open, then shows the question's
request timeline. Needs Debian's chromium and Playwright for Python (the dev extra).

    .venv/bin/python docs/ui_screenshots.py docs/images
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from playwright.sync_api import expect, sync_playwright
from server_process import ServerProcess

QUESTION = "In two sentences, why do rivers meander?"


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(None).wait_healthy(timeout=600)
    done = threading.Event()
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path="/usr/bin/chromium", args=["--no-sandbox"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 820})
            page.set_default_timeout(120_000)
            page.goto(server.url + "/")
            expect(page.locator("body")).to_have_attribute("data-ready", "true")
            client = server.client()
            client.chat.completions.create(  # warm-up: the first steps run slower
                model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
            )
            page.fill("#temperature", "0.3")
            page.fill("#seed", "4")
            page.fill("#prompt", QUESTION)
            page.click("#send")
            expect(page.locator("#stats")).to_contain_text("tokens/s")
            page.hover("#answer .tok >> nth=6")
            page.screenshot(path=str(out / "playground.png"))

            def load() -> None:
                while not done.is_set():
                    client.completions.create(
                        model=server.model,
                        prompt="Write a long story about a lighthouse keeper.",
                        max_tokens=96,
                        extra_body={"ignore_eos": True},
                    )

            threads = [threading.Thread(target=load) for _ in range(16)]
            for t in threads:
                t.start()
            page.click("#tab-graph")
            page.wait_for_timeout(6000)
            page.screenshot(path=str(out / "graph-under-load.png"))
            done.set()
            for t in threads:
                t.join()
            page.click("#tab-timeline")
            expect(page.locator("#timeline .lane")).not_to_have_count(0)
            page.screenshot(path=str(out / "timeline.png"))
            browser.close()
    finally:
        done.set()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images")))
