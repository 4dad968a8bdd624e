"""Fixtures every test module may use; they live in tests/support/fixtures.py."""

from tests.support.fixtures import peered_pair, solo_daemon

__all__ = ["peered_pair", "solo_daemon"]
