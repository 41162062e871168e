"""The API key through the Ray ingress: the e2e test, on a replicated server with a key."""

from test_e2e_errors import test_auth_on  # noqa: F401  (on this directory's `auth_server`)
