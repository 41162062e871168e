"""The scheduler's tests run twice: with the running sequences scheduled as columns
from the first one on, and one by one whatever their number (`Scheduler.columns_from`),
so both ways are held to the same expectations."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flowllm.scheduling import scheduler


@pytest.fixture(params=["columns", "one-by-one"])
def running_rows_way(request: pytest.FixtureRequest) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler, "COLUMNS_FROM", 1 if request.param == "columns" else 10**9)
        yield request.param
