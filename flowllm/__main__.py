"""`python -m flowllm` is the `flowllm` command."""

from flowllm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
