"""Reproducible benchmarks; each writes JSON and a PNG under bench/results/."""
