"""The parts of scripts/bench.py: timing helpers and the decoding benchmarks."""
