"""``python -m benchmarks``: the whole benchmark table (see :mod:`benchmarks.run`)."""

from benchmarks.run import main

if __name__ == "__main__":
    raise SystemExit(main())
