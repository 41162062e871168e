"""Python's cyclic garbage collector paused while a server process starts.

Why: importing torch, transformers and the HTTP stack and loading the model make hundreds
of thousands of objects that live as long as the process; the collections they set off on
the way find little garbage, and cost about a tenth of the start's CPU (benchmarks/README.md,
"Start-up"). Paused, then one collection once loaded frees what did become garbage, so
nothing is kept that would have been freed.
"""

from __future__ import annotations

import gc


def pause() -> None:
    """No automatic collections until `settle`."""
    gc.disable()


def settle(freeze: bool) -> None:
    """Collect once, then collect automatically again; with `freeze`, the survivors (the
    model, tokenizer and libraries: long-lived) out of later collections' sight, so that a
    full collection no longer stalls the event loop for scanning them."""
    gc.collect()
    if freeze:
        gc.freeze()
    gc.enable()
