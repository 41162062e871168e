"""Admission through the Ray ingress: a flood against replicas that admit 2 requests each
gets 503 + Retry-After at once, and every admitted request completes (the e2e test)."""

from test_e2e_load import test_flood_gets_503_with_retry_after  # noqa: F401
