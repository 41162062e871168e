"""The process's logging: structlog configured once, stdlib loggers (uvicorn's) routed
through it, as console lines or JSON."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LOG_FORMATS = ("auto", "console", "json")


def configure_logging(
    *,
    fmt: str | None = None,
    level: str | int | None = None,
    stream: TextIO | None = None,
    force: bool = False,
    capture_stdlib: bool = False,
) -> None:
    """Set structlog up once: console on a TTY, JSON lines otherwise.

    `fmt` ("auto", "console", "json") and `level` default to the environment variables
    FLOWLLM_LOG_FORMAT and FLOWLLM_LOG_LEVEL, then to "auto" and "info". Without `force`, an
    existing structlog configuration (the application's own) is left alone.
    `capture_stdlib` (the server) also renders the standard library's log records, such as
    uvicorn's access and error logs, and Python's warnings, the same way, so that every
    line of the process is one format.
    """
    if structlog.is_configured() and not force:
        return
    out = stream if stream is not None else sys.stderr
    fmt = (fmt or os.environ.get("FLOWLLM_LOG_FORMAT") or "auto").lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    if fmt == "auto":
        fmt = "console" if out.isatty() else "json"
    raw_level = level if level is not None else os.environ.get("FLOWLLM_LOG_LEVEL", "info")
    numeric = raw_level if isinstance(raw_level, int) else logging.getLevelName(raw_level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {raw_level!r}")
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[Processor] = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        if fmt == "json"
        else [structlog.dev.ConsoleRenderer(colors=out.isatty())]
    )
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    if capture_stdlib:
        _capture_stdlib(shared, renderer, numeric, out)


class _StructlogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler `configure_logging` installs (replaced when it runs again)."""


def _capture_stdlib(
    shared: list[Processor], renderer: list[Processor], level: int, out: TextIO
) -> None:
    handler = _StructlogHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, _access_fields],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
            pass_foreign_args=True,
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StructlogHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.captureWarnings(True)


def _access_fields(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """uvicorn's access line as fields too (client, method, path, status)."""
    args = event.pop("positional_args", None)
    record = event.get("_record")
    if record is not None and record.name == "uvicorn.access" and len(args or ()) == 5:
        client, http_method, path, version, status = args
        event.update(
            client=client, method=http_method, path=path, http_version=version, status=status
        )
    return event
