"""Sizes shared by the static-graph tests."""

SEED = 3
CHUNK = 4
CAPACITY = 24
MAX_INPUT = 16
CPU = ["CPUExecutionProvider"]
