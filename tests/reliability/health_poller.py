"""GET URL/health every INTERVAL seconds until a line arrives on stdin, then print the
latencies of the 200s and every other outcome as JSON: `python health_poller.py URL INTERVAL`.

Run as a process of its own by `reliability_helpers.HealthPoller`, so the load the test
itself generates does not delay the probe.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def main() -> None:
    url, interval = sys.argv[1], float(sys.argv[2])
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    latencies: list[float] = []
    failures: list[str] = []
    started = time.monotonic()
    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                status = client.get(f"{url}/health").status_code
            except httpx.HTTPError as exc:
                failures.append(f"{t0 - started:.2f}s: {type(exc).__name__}: {exc}")
            else:
                elapsed = time.monotonic() - t0
                if status == 200:
                    latencies.append(elapsed)
                else:
                    failures.append(f"{t0 - started:.2f}s: status {status} in {elapsed:.3f}s")
            stop.wait(interval)
    json.dump({"latencies": latencies, "failures": failures}, sys.stdout)


if __name__ == "__main__":
    main()
