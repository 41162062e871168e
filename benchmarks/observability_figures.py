"""The figures of docs/observability.md, drawn from exported data (no Grafana or trace UI
here): the bundled model served with traces exported over OTLP to a receiver and scraped
by a real Prometheus every second while `flowllm bench serve` loads it; then one streamed
request's trace as a timeline of its decoded spans, and every panel of the Grafana
dashboard as Prometheus evaluates its queries over the load.

    .venv/bin/python benchmarks/observability_figures.py --num-prompts 64   # docs/*.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "observability"))

from otlp_receiver import OtlpReceiver, attributes  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402

DASHBOARD = REPO / "examples" / "grafana" / "flowllm-dashboard.json"


def start_prometheus(target: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: flowllm, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = free_port()
    process = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return process, f"http://127.0.0.1:{port}"


def draw_trace(receiver: OtlpReceiver, request_id: str, out: Path) -> None:
    spans = receiver.wait_for(
        lambda spans: any(attributes(s).get("flowllm.request_id") == request_id for s in spans)
    )
    (root,) = [s for s in spans if attributes(s).get("flowllm.request_id") == request_id]
    children = [s for s in spans if s.parent_span_id == root.span_id]
    linked = [s for s in spans if any(link.span_id == root.span_id for link in s.links)]
    rows = [root, *sorted(children, key=lambda s: s.start_time_unix_nano)]
    steps = sorted(linked, key=lambda s: s.start_time_unix_nano)
    names = sorted({s.name for s in steps})
    t0 = root.start_time_unix_nano
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = []
    for y, span in enumerate(rows):
        start = (span.start_time_unix_nano - t0) / 1e6
        width = max((span.end_time_unix_nano - span.start_time_unix_nano) / 1e6, 0.3)
        ax.barh(y, width, left=start, color="#3b73b9" if y == 0 else "#6aa84f")
        wait = attributes(span).get("flowllm.queue_wait_s")
        suffix = f"  (waited {wait * 1e3:.2f} ms)" if isinstance(wait, float) else ""
        labels.append(span.name + suffix)
    for i, name in enumerate(names):
        y = len(rows) + i
        for span in (s for s in steps if s.name == name):
            start = (span.start_time_unix_nano - t0) / 1e6
            width = max((span.end_time_unix_nano - span.start_time_unix_nano) / 1e6, 0.3)
            ax.barh(y, width, left=start, color="#e69138")
        labels.append(f"{name}  (linked, {sum(s.name == name for s in steps)} steps)")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the request arrived")
    attrs = attributes(root)
    ax.set_title(
        f"{root.name}: {attrs.get('gen_ai.usage.input_tokens')} prompt tokens, "
        f"{attrs.get('gen_ai.usage.output_tokens')} generated, TTFT "
        f"{float(attrs.get('gen_ai.latency.time_to_first_token', 0)) * 1e3:.0f} ms"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def draw_dashboard(prometheus: str, model: str, start: float, end: float, out: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    cols = 3
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(15, 3 * len(panels) / cols))
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            expr = target["expr"].replace("$model_name", model)
            expr = expr.replace("$__rate_interval", "15s")
            data = httpx.get(
                f"{prometheus}/api/v1/query_range",
                params={"query": expr, "start": start, "end": end, "step": 2},
                timeout=30,
            ).json()["data"]["result"]
            for series in data:
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                legend = target["legendFormat"]
                for key, value in series["metric"].items():
                    legend = legend.replace("{{" + key + "}}", value)
                ax.plot(xs, ys, label=legend, linewidth=1.2)
        ax.set_title(panel["title"], fontsize=10)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("flowllm dashboard (queries evaluated by Prometheus; x: seconds)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs")
    args = ap.parse_args()
    receiver = OtlpReceiver()
    server = ServerProcess(None, ["--otlp-traces-endpoint", receiver.url])
    with tempfile.TemporaryDirectory() as tmp:
        try:
            server.wait_healthy()
            prometheus, prometheus_url = start_prometheus(server.url[len("http://") :], Path(tmp))
            try:
                time.sleep(3)
                start = time.time()
                subprocess.run(
                    [sys.executable, "-m", "flowllm", "bench", "serve", "--base-url", server.url,
                     "--num-prompts", str(args.num_prompts), "--max-concurrency", "16",
                     "--random-input-len", "128", "--random-output-len", "96",
                     "--request-rate", "4", "--disable-tqdm"],
                    check=True, cwd=REPO, stdout=subprocess.DEVNULL,
                )  # fmt: skip
                response = httpx.post(
                    f"{server.url}/v1/completions",
                    json={"model": server.model, "prompt": "The weather today is",
                          "max_tokens": 16, "stream": True},
                    timeout=60,
                )  # fmt: skip
                time.sleep(3)
                end = time.time()
                draw_trace(
                    receiver, response.headers["x-request-id"],
                    args.out_dir / "observability-trace.png",
                )  # fmt: skip
                draw_dashboard(
                    prometheus_url, server.model, start, end,
                    args.out_dir / "observability-dashboard.png",
                )  # fmt: skip
            finally:
                prometheus.terminate()
                prometheus.wait(timeout=30)
        finally:
            server.stop()
            receiver.close()


if __name__ == "__main__":
    main()
