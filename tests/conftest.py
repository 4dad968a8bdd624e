"""Fixtures every test module may use; they live in tests/support/fixtures.py."""

from tests.support.fixtures import peered_pair, small_tmpfs, solo_daemon

__all__ = ["peered_pair", "small_tmpfs", "solo_daemon"]
