"""Test and bench harness: what only tests/, tests_vllm/, bench/ and tools/ use.

Not installed (pyproject.toml installs daemon, statemachine and schemas
only): crash rounds, fuzzing, the load fleet, profiling, the CUDA IPC
helper and the lifecycle recorder. It may import the package and its test
dependencies (hypothesis); the package never imports it.
"""
