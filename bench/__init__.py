"""Benchmarks (`infc bench ...`); their results are committed under bench/results/."""
