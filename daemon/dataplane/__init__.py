"""The data plane: KV blocks pushed to peers with NIXL WRITEs.

Its modules, in the order a write flows through them:

- ``plane.py``: :class:`DataPlane`, the async facade the daemon uses, and
  the public errors (defined in ``errors.py``);
- ``geometry.py``: descriptor lists and indices, layout checks; pure;
- ``worker.py``: the one thread that owns the NIXL agent, and its commands;
- ``window.py``: the per-peer windows a remote WRITE lands through;
- ``memory.py``: DRAM regions (engine KV caches in /dev/shm), offload slots;
- ``vram.py``: VRAM regions (GPU KV caches opened from CUDA IPC handles).
"""
