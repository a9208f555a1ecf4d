"""The benchmarks of ``docs/benchmarks.md``: one package per section, shared code in ``benchmarks.common``.

Run a driver from the repository root as a module, ``python -m benchmarks.<section>.<driver>`` (``--help`` lists its
options), or through its ``make`` target; ``benchmarks/README.md`` maps every table and figure to both, to its
results folder and to the renderer that draws it.
"""
