"""The shared test harness (nothing here is a test).

``fixtures``  real daemons as pytest fixtures (registered in tests/conftest.py)
              and the clean-stop check they end with
``journals``  reading and rewriting journal records, for tests that plant damage
``imports``   the static import scanner and graph of test_purity and test_layout
``waiting``   polling a condition off the loop; whether a process is stopped

Real daemon processes (the launcher) and the simulated engine live in the
package, under daemon/sim/ (what ``kvpushd demo`` runs); the harnesses that
tools share with tests (crash rounds, fuzzing, the load fleet, the lifecycle
driver, the engine process, the tiny checkpoints and the vLLM servers) live
in harness/ (not installed), so that bench/ and tools/ never import tests/.
No test module imports another: what two of them share belongs here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[2]
