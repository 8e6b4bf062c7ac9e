"""Helpers shared by the benchmark scripts: pure harness logic, child processes, workers."""
