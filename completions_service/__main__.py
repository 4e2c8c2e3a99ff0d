"""``python -m completions_service``: the same as the ``completions-service`` command."""

from completions_service.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
