"""Experiments and benchmarks for buddy: real offline workloads, codec benchmarks."""
