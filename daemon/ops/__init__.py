"""Operator commands on one node: ``kvpushd status`` and ``kvpushd journal verify|show|stats``.

- ``status.py``: ask a running daemon for its status and show it;
- ``journal.py``: check, print and count one node's journal;
- ``texttable.py``: the plain-text tables they (and the postmortem) print.
"""
