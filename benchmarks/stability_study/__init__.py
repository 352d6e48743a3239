"""The stability study behind `benchmarks/study.py` (`make study`): grid, runs, analysis, report."""
