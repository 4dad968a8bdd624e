"""The journal: every transition of every request, durable before anyone is told.

Its modules, in the order a record flows through them:

- ``writer.py``: :class:`Journal`, the one writer of a directory: append,
  commit, segments, snapshots, pruning;
- ``format.py``: the on-disk format (its specification: format 1, a frame
  per record; format 2, a frame per commit), framing and CRCs, file headers
  and names, the errors;
- ``groupcommit.py``: :class:`GroupCommit`, the daemon's one commit
  mechanism: many appends, one fdatasync, off the event loop;
- ``recovery.py``: taking a directory over on open: the lock, the torn tail;
- ``reader.py``: :func:`read_journal`: validation, torn tails, salvage; the
  unchecked read and the clean shape of the optimistic replay;
- ``replay.py``: folding the records through the core, as on start; offline,
  a large journal folds unchecked while a forked child checks its CRCs;
- ``stats.py``: counts and latencies gathered during a fold.
"""
