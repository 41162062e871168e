"""Python's cyclic garbage collector paused while a server process starts.

Why: importing torch, transformers and the HTTP stack and loading the model make hundreds
of thousands of objects that live as long as the process; the collections they set off on
the way find little garbage, and cost a share of the start's CPU. Once loaded, the
survivors are frozen out of later collections' sight, so that a full collection no longer
stalls the event loop for scanning them. What became garbage in cycles meanwhile (little,
for the bundled model's front) is frozen with them rather than found by a full collection,
which would scan every survivor during the start (benchmarks/README.md, "Start-up", has
the figures).
"""

from __future__ import annotations

import gc


def pause() -> None:
    """No automatic collections until `settle`."""
    gc.disable()


def settle() -> None:
    """Freeze what the start made, then collect automatically again."""
    gc.freeze()
    gc.enable()
