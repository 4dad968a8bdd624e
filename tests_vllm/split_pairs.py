"""Two vLLM instances of different parallel shapes, and the check of a load split across ranks.

Shared by test_pd_tp.py (TP 2 beside TP 1) and test_pd_pp.py (PP 2 beside
PP 1): each instance is kv_both beside its own daemon (either may prefill),
both daemons check every write end to end (``verify = "all"``).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from refusals import the_pairing_refusal

from daemon.sim.launcher import Daemon, free_port, wait_idle
from harness.vllm_router import prefill_leg
from harness.vllm_servers import (
    EXTERNAL_TOKENS,
    VllmServer,
    kvpushd_connector_config,
    remove_vllm_shm_segments,
    running,
    vllm_shm_segments,
)
from schemas.events import Failed, Registered, Released, WriteDone
from schemas.reasons import Reason

TOKENS = 8
# The integrity check reads every written slice back on both sides.
VERIFY_ALL = '[integrity]\nverify = "all"'
Side = tuple[VllmServer, Daemon]


@dataclass(frozen=True)
class Shape:
    """One instance of the pair: its name, parallel sizes, and what else it runs with."""

    name: str
    tp: int = 1
    pp: int = 1
    eager: bool = True
    env: dict[str, str] = field(default_factory=dict)
    block_size: int = 32
    args: tuple[str, ...] = ()


@contextlib.contextmanager
def split_pair(model: Path, workdir: Path, shapes: Sequence[Shape]) -> Iterator[list[Side]]:
    """The instances of ``shapes``, one core each, every one beside its own daemon.

    A failed load is recomputed (``kv_load_failure_policy``), so a negative
    control's tokens stay right. The shared-memory segments ranks leave
    behind are removed after; both daemons must stop with 0.
    """
    cores = sorted(os.sched_getaffinity(0))
    daemons = [
        Daemon(shape.name, workdir, free_port(), extra=VERIFY_ALL).start() for shape in shapes
    ]
    servers = [
        VllmServer(
            shape.name.upper(),
            model,
            workdir,
            core=core,
            tp=shape.tp,
            pp=shape.pp,
            eager=shape.eager,
            env=shape.env,
            block_size=shape.block_size,
            extra_args=[
                "--kv-transfer-config",
                kvpushd_connector_config("kv_both", daemon, kv_load_failure_policy="recompute"),
                *shape.args,
            ],
        )
        for shape, core, daemon in zip(shapes, (cores[0], cores[-1]), daemons, strict=True)
    ]
    shm_before = vllm_shm_segments()
    try:
        with running(*servers):
            yield list(zip(servers, daemons, strict=True))
    finally:
        remove_vllm_shm_segments(vllm_shm_segments() - shm_before)
        assert [daemon.stop() for daemon in daemons] == [0, 0]


class Engines(NamedTuple):
    """The engines a transfer's shares were registered on, per side."""

    prefill: set[str]
    decode: set[str]


def load_split_across_ranks(
    prefill_side: Side,
    decode_side: Side,
    prompt: list[int],
    suffixes: Sequence[str],
    decode_tp: int | None = None,
    decode_pp: int | None = None,
) -> Engines:
    """One P/D request whose load is split over ranks; the engines its shares used.

    The decode's tokens equal the prefill instance's alone (its own answer,
    asked first: asked on the decode, the prompt would be a local prefix
    hit there), the external-KV counter moved by the prompt, every share
    (the transfer id + each of ``suffixes``) was written and released on
    both daemons, and every written block passed the integrity check.
    ``decode_tp``, ``decode_pp``: the decode's sizes, named on the prefill leg.
    """
    (p, prefill), (d, decode) = prefill_side, decode_side
    verified = decode.status()["counters"]["integrity_blocks_verified"]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt, decode_tp=decode_tp, decode_pp=decode_pp)
    before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, len(prompt)
    loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
    assert loaded >= len(prompt) - 1, (len(prompt), loaded)
    wait_idle(prefill, decode)
    engines = Engines(set(), set())
    for suffix in suffixes:
        share = f"{sent['kvpushd_transfer_id']}{suffix}"
        for daemon, used in ((prefill, engines.prefill), (decode, engines.decode)):
            events = daemon.journal_events(share)
            kinds = [type(e) for e in events]
            assert WriteDone in kinds and kinds[-1] is Released, (daemon.node, share, kinds)
            (registered,) = [e for e in events if isinstance(e, Registered)]
            used.add(registered.engine_id)
    counters = decode.status()["counters"]
    assert counters["integrity_mismatches"] == 0
    assert counters["integrity_blocks_verified"] > verified, counters
    return engines


def not_paired(prefill_side: Side, decode_side: Side, prompt: list[int], field_name: str) -> None:
    """A P/D request between instances whose ranks do not map: the decode computes the prompt.

    Its tokens are its own, no external token is counted, and the prefill's
    push ends at once (well before its 30 s deadline), refused by the
    prefill daemon naming ``field_name``; the decode daemon journals why.
    """
    (p, prefill), (d, decode) = prefill_side, decode_side
    single = d.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") == before
    wait_idle(prefill, decode, timeout=10)
    transfer = sent["kvpushd_transfer_id"]
    events = prefill.journal_events(transfer)
    refused = the_pairing_refusal(events)
    assert refused.reason is Reason.FINGERPRINT_MISMATCH, events
    assert f"field {field_name!r} differs" in refused.message, refused.message
    (failed,) = [e for e in decode.journal_events(transfer) if isinstance(e, Failed)]
    assert failed.reason is Reason.FINGERPRINT_MISMATCH


def a_split_push_mis_mapped_is_refused(
    prefill_side: Side,
    decode_side: Side,
    suffixes: Sequence[str],
    field_name: str,
    decode_tp: int | None = None,
    decode_pp: int | None = None,
) -> None:
    """The negative control of a split push: each share read from the wrong slice.

    Armed by ``connector.swap_split`` on the prefill's first split push:
    the prefill daemon refuses every share's pairing naming ``field_name``,
    no write lands, every share ends released, and the decode (its failed
    load recomputed, split_pair's policy) still gives the right tokens.
    """
    (p, prefill), (d, decode) = prefill_side, decode_side
    prompt = [(7 * i) % 509 + 2 for i in range(96)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt, decode_tp=decode_tp, decode_pp=decode_pp)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode, timeout=10)
    for suffix in suffixes:
        share = f"{sent['kvpushd_transfer_id']}{suffix}"
        refused = the_pairing_refusal(prefill.journal_events(share))
        assert f"field {field_name!r} differs" in refused.message, refused.message
        events = decode.journal_events(share)
        assert not [e for e in events if isinstance(e, WriteDone)], events
        assert isinstance(events[-1], Released), events


def a_split_push_fills_each_decode_rank(
    prefill_side: Side,
    decode_side: Side,
    suffixes: Sequence[str],
    refused_by: str,
    slice_mark: str,
    *,
    seed: int,
    decode_tp: int | None = None,
    decode_pp: int | None = None,
) -> None:
    """A prefill told the decode's larger size: the negative control, then two P/D requests.

    The control comes first (``connector.swap_split`` fires on the
    prefill's first split push). Then each decode rank (or stage) loads its
    share (a suffix of ``suffixes``) on its own engine, into its whole
    blocks, and each share is read from the prefill's slice of the heads or
    layers that rank holds (engine ids ending ``<slice_mark>0-1`` and
    ``<slice_mark>1-2`` on the tiny model).
    """
    sizes = {"decode_tp": decode_tp, "decode_pp": decode_pp}
    a_split_push_mis_mapped_is_refused(prefill_side, decode_side, suffixes, refused_by, **sizes)
    rng = random.Random(seed)
    for length in (40, 200):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        engines = load_split_across_ranks(prefill_side, decode_side, prompt, suffixes, **sizes)
        ranks = sorted(suffix.rsplit("@", 1)[-1] for suffix in suffixes)
        assert sorted(e.rsplit("-", 1)[-1] for e in engines.decode) == ranks, engines
        read_from = sorted(e.rsplit(slice_mark, 1)[-1] for e in engines.prefill)
        assert read_from == ["0-1", "1-2"], engines
