"""This daemon's version: what ``DaemonStarted``, status, the engine ``HelloOk`` and metrics say.

pyproject.toml's ``version``; tests/test_cli_text.py checks that ``kvpushd --version``
(read from the installed package's metadata) says the same.
"""

from typing import Final

VERSION: Final = "0.1.0"
