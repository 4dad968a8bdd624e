"""Test and bench harness: what only tests/, tests_vllm/, bench/ and tools/ use.

Not installed (pyproject.toml installs daemon, statemachine and schemas
only): crash rounds, fuzzing, the load fleet, profiling, the CUDA IPC
helper, the lifecycle recorder, the simulated engine as a process
(``engine_process``), and for real vLLM the tiny seeded checkpoints
(``tinyllama``, ``tinydeepseek``, ``tinynemotron``), the server harness
(``vllm_servers``), the P/D router (``vllm_router``), ``make demo-vllm``
(``vllm_demo``), the P/D fuzzer and the probes. It may import the package
and its test dependencies (hypothesis), never tests/; the package never
imports it.
"""
