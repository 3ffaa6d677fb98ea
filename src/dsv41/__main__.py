"""`python -m dsv41 ...` — the same as the `dsv41` console script."""

from dsv41.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
