"""The project's measurements around the package: benchmarks (bench_*), soak tests (soak_*), the drivers of studies
and checks (cross_engine, check_transformers, gpu_check, attention_paths_smollm2, memory_breakdown, tiny_table,
code_metrics) and the documentation's generated tables (docs_tables), with their shared helpers (benchutil) and the
committed results files (results/, whose README.md says which command made each).

Every script is a module of this package, run from the repository root:

    python -m eval.docs_tables --check
    python -m eval.bench_patch --help

A benchmark that measures in fresh processes starts them the same way (`python -m eval.NAME --worker ...`, from the
repository root). This package is not installed with hfpatch: it lives in the repository only.
"""
