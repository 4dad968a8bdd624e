"""A LoRA adapter's content, for the block hashes: vLLM keys an adapter by name and path only.

vLLM's block hash names a request's adapter by ``lora_name`` and
``lora_path`` (``_gen_lora_extra_hash_keys`` in vllm/v1/core/kv_cache_utils.py):
an adapter rewritten in place (same name, same path, other weights) hashes
alike on two instances that loaded different weights, and the decode loaded
KV of the other adapter (8/8 wrong tokens before this key).
:func:`adapter_key` adds the adapter's content to the first block's extra
keys (hashes.py ``block_hashes``; the chain carries it to every block), on
both sides.

The content is BLAKE2b-128 over the adapter's weight and config files (what
vLLM's LoRA loader reads: ``adapter_*`` and ``new_embeddings*``; every file
of a folder that has none of them), by name, size and bytes. It is read
when this instance first sees the adapter (its name, vLLM's integer id and
its path), which is when vLLM loads it (the worker loads an adapter for the
first request that names it), and kept for as long as the instance knows
the adapter under that id, at most :data:`MAX_CACHED` adapters: the digest
names the weights the instance loaded, not the files as they are now. An
instance that loaded an adapter before a rolling upgrade rewrote its files
in place keeps naming the old weights, which it still holds, so a decode
that started on the new ones never pairs with it. (Read at hash time, the
old instance named the new files' digest while computing with the old
weights, and paired.) A path that is not a local folder or file (a hub id
vLLM downloads) or cannot be read adds no key: vLLM's name and path alone,
and the decode's own K/V check (kvcheck.py) behind them, as it is behind an
adapter vLLM evicted and loaded again from rewritten files.

Pure: no vLLM, no torch (a request's ``lora_request`` is read by attribute).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(f"vllm.{__name__}")

# The extra key's tag, beside vLLM's own ("lora", name, path).
TAG: Final = "lora-content"
MAX_CACHED: Final = 64
_PREFIXES: Final = ("adapter_", "new_embeddings")
_CHUNK: Final = 1 << 20

# (name, vLLM's integer id, path) -> the digest read when this instance first saw it.
_cache: dict[tuple[str, int, str], str] = {}


def adapter_key(request: Any) -> tuple[str, str] | None:
    """The extra key naming a request's adapter by content, or None (no adapter, or not read)."""
    lora = getattr(request, "lora_request", None)
    path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
    if not path:
        return None
    seen = (str(getattr(lora, "lora_name", "")), int(getattr(lora, "lora_int_id", 0)), str(path))
    digest = _cache.get(seen)
    if digest is None:
        digest = adapter_digest(str(path))
        while len(_cache) >= MAX_CACHED:
            del _cache[next(iter(_cache))]
        _cache[seen] = digest
    return (TAG, digest) if digest else None


def adapter_digest(path: str) -> str:
    """The content digest of the adapter at ``path`` (hex; "": not local, or unreadable)."""
    try:
        return _digest(_files(Path(path)))
    except OSError as exc:
        log.warning(
            "kvpushd: LoRA adapter %s not read (%s): keyed by name and path only", path, exc
        )
        return ""


def _files(path: Path) -> list[tuple[Path, os.stat_result]]:
    if path.is_file():
        return [(path, path.stat())]
    if not path.is_dir():
        return []
    every = sorted((f for f in path.iterdir() if f.is_file()), key=lambda f: f.name)
    weights = [f for f in every if f.name.startswith(_PREFIXES)]
    return [(f, f.stat()) for f in weights or every]


def _digest(files: list[tuple[Path, os.stat_result]]) -> str:
    if not files:
        return ""
    h = hashlib.blake2b(digest_size=16)
    for f, st in files:
        h.update(f"{f.name}|{st.st_size}|".encode())
        with f.open("rb") as stream:
            while chunk := stream.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()
