"""Side-by-side benchmarks: bigmodel vs accelerate 1.15.0 vs the physical floor.

Run ``python -m benchmarks`` (or ``make bench``) from the repository root with the
benchmark venv (``.venv-bench``: it sees ``.venv`` and adds ``accelerate==1.15.0``).

Layout:
    fixtures.py   checkpoints and meta models built locally into ``.bench-cache/``
    measure.py    what one child process measures: time, peak RSS, peak anonymous RSS
    worker.py     the child entry point: import one implementation, run one case
    cases/        one module per case; each case is one function of the library module
    __main__.py   the runner: schedule A/B/floor interleaved, medians, the table
"""
