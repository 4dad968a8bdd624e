"""Hostile and broken input: the engine RPC, the peer link and the journal decoder.

The surfaces, their generators and the oracle live in
:mod:`harness.fuzzing` (shared with ``tools/fuzz_soak.py``, which runs
them at a larger scale): every input gets an error reply or a closed
connection, never an ``internal`` error or an undecodable frame; the daemons
stay up; invalid input leaves the registry as it was (status and a replay of
the journal agree, before and after); the journal readers either succeed or
report damage. Here each surface runs against two real daemons for a few
hundred cases, next to regressions found by fuzzing. The last test pushes
real bytes through both daemons to show they still work.

Scale: ``KVPUSHD_FUZZ_SCALE`` multiplies every case count (default 1: a few
thousand cases, well under a minute). Cases are derandomized in CI, so a run
is repeatable; set ``KVPUSHD_FUZZ_RANDOM=1`` for fresh ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from daemon.dataplane.memory import create_shm_file
from daemon.framing import frame_bytes
from daemon.node.peerauth import NONCE_BYTES, auth_mac
from harness.fuzzing import (
    FuzzFailure,
    FuzzTarget,
    JournalSandbox,
    PeerConn,
    RpcConn,
    apply_byte_mutation,
    both_views,
    byte_mutations,
    encode_body,
    end_requests,
    error_log_lines,
    fuzz_pair,
    journal_bytes_case,
    journal_records_case,
    peer_batches,
    peer_frame,
    peer_frames_case,
    peer_stream_case,
    peer_streams,
    push_once,
    record_mutations,
    rpc_batches,
    rpc_frames_case,
    rpc_sequence_case,
    rpc_stream_case,
    rpc_streams,
    run_cases,
    scaled,
    sequence_ops,
    set_baseline,
    target_baseline,
    wait_settled,
)
from schemas import peer as pm
from schemas import rpc
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind, Role


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    with fuzz_pair(tmp_path_factory.mktemp("fuzz")) as fuzz:
        fuzz.sequence_engine()  # registered first: the baseline includes it
        set_baseline(fuzz)
        yield fuzz


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> JournalSandbox:
    return JournalSandbox(tmp_path_factory.mktemp("journal-fuzz"))


def _unchanged(target: FuzzTarget) -> None:
    target.alive()
    if both_views(target.prefill) != target_baseline(target):
        raise FuzzFailure("the prefill registry changed")
    decode = both_views(target.decode)
    assert not decode.requests and decode.pending == 0, decode


def test_rpc_random_truncated_and_oversized_streams(target: FuzzTarget) -> None:
    ran = run_cases(rpc_streams(), lambda c: rpc_stream_case(target, c), scaled(250))
    assert ran >= scaled(250) // 2
    _unchanged(target)


def test_rpc_hostile_frames_on_one_connection(target: FuzzTarget) -> None:
    ran = run_cases(rpc_batches, lambda c: rpc_frames_case(target, c), scaled(300))
    assert ran >= scaled(300)
    _unchanged(target)


def test_rpc_requests_out_of_order(target: FuzzTarget) -> None:
    ran = run_cases(sequence_ops, lambda c: rpc_sequence_case(target, c), scaled(80))
    assert ran >= scaled(80)
    _unchanged(target)


def test_rpc_named_out_of_order_cases(target: FuzzTarget) -> None:
    """The orders the brief names, with the exact refusal each one gets."""
    engine = target.sequence_engine()
    conn, eid = engine.conn, engine.engine_id
    rid = f"named-{uuid.uuid4().hex[:6]}"

    def call(request: rpc.Request) -> rpc.Reply:
        return conn.call(request)

    def code(request: rpc.Request) -> str:
        reply = call(request)
        assert isinstance(reply, rpc.Error), reply
        return reply.code

    assert code(rpc.KvReady(conn.next_id(), rid)) == "unknown_request"  # before register
    assert code(rpc.Release(conn.next_id(), rid)) == "unknown_request"
    reg = rpc.RegisterRequest(conn.next_id(), eid, rid, Role.PUSHER, ((1, 2), (3,)))
    assert isinstance(call(reg), rpc.RequestAccepted)
    dup = rpc.RegisterRequest(conn.next_id(), eid, rid, Role.PUSHER, ((4,), (5,)))
    assert code(dup) == "duplicate_request"
    assert code(rpc.KvReady(conn.next_id(), rid, incarnation=2)) == "unknown_request"
    assert isinstance(call(rpc.Abort(conn.next_id(), rid)), rpc.Ok)
    assert isinstance(call(rpc.Release(conn.next_id(), rid)), rpc.Ok)
    assert code(rpc.Release(conn.next_id(), rid)) == "stale_incarnation"  # release twice
    assert code(rpc.Abort(conn.next_id(), rid)) == "stale_incarnation"
    assert code(rpc.KvReady(conn.next_id(), rid)) == "stale_incarnation"
    out_of_range = rpc.RegisterRequest(conn.next_id(), eid, rid + "x", Role.PUSHER, ((64,), ()))
    assert code(out_of_range) == "block_out_of_range"
    negative = rpc.RegisterRequest(conn.next_id(), eid, rid + "x", Role.PUSHER, ((-1,), ()))
    assert code(negative) == "block_out_of_range"
    # Group 1 spans 2 kernel blocks per logical block: logical 32 is kernel 64..65.
    expanded = rpc.RegisterRequest(conn.next_id(), eid, rid + "x", Role.PUSHER, ((), (32,)))
    assert code(expanded) == "block_out_of_range"
    receiver = rpc.RegisterRequest(
        conn.next_id(), eid, rid + "r", Role.RECEIVER, ((1,), ()), peer="decode"
    )
    assert isinstance(call(receiver), rpc.RequestAccepted)
    assert code(rpc.KvReady(conn.next_id(), rid + "r")) == "role_mismatch"
    end_requests(target, conn, [rid, rid + "r", rid + "x"])
    # Another connection may not touch this engine's requests.
    with RpcConn(target.prefill.socket) as other:
        stolen = rpc.RegisterRequest(other.next_id(), eid, rid + "s", Role.PUSHER, ((1,), ()))
        reply = other.call(stolen)
        assert isinstance(reply, rpc.Error) and reply.code == "unknown_engine", reply
    _unchanged(target)


def test_rpc_bool_id_gets_a_decodable_error(target: FuzzTarget) -> None:
    """Regression: an Error echoing a bool id was undecodable for the client."""
    with RpcConn(target.prefill.socket) as conn:
        (reply,) = conn.exchange(frame_bytes(encode_body({"op": "nope", "id": True})), 1)
        assert isinstance(reply, rpc.Error) and reply.id == 0 and reply.code == "bad_request"


def test_registration_too_big_for_a_record_or_a_peer_frame_is_refused(
    target: FuzzTarget,
) -> None:
    """Regression: 16,384 logical blocks expand to 1,048,576 kernel blocks (5 MB encoded).

    The pusher's record used to fail to append after the registry had taken
    it (live state the journal did not have); the receiver's was journaled
    but its Forward never reached the peer. Both replied "internal".
    """
    tag = uuid.uuid4().hex[:6]
    num_blocks, per_logical = 1 << 20, 64
    region = create_shm_file(f"/dev/shm/kvpushd-fuzz-big-{tag}", num_blocks)
    layer = (LayerSpec(region.name),)
    groups = (GroupSpec(GroupKind.ATTENTION, num_blocks, 1, layer, per_logical),)
    everything = (tuple(range(num_blocks // per_logical)),)
    try:
        with RpcConn(target.prefill.socket) as conn:
            reply = conn.call(rpc.RegisterEngine(conn.next_id(), f"big-{tag}", groups, (region,)))
            assert isinstance(reply, rpc.Ok), reply
            for role, peer in ((Role.PUSHER, ""), (Role.RECEIVER, "decode")):
                request = rpc.RegisterRequest(
                    conn.next_id(), f"big-{tag}", f"big-{role}", role, everything, peer=peer
                )
                reply = conn.call(request)
                assert isinstance(reply, rpc.Error), reply
                assert reply.code == "block_out_of_range" and "1048576 kernel blocks" in (
                    reply.message
                ), reply
            # Half of it fits: the limit is about size, not a cap on engines.
            half = (everything[0][: len(everything[0]) // 2],)
            request = rpc.RegisterRequest(conn.next_id(), f"big-{tag}", "big-ok", Role.PUSHER, half)
            assert isinstance(conn.call(request), rpc.RequestAccepted)
            assert isinstance(conn.call(rpc.Abort(conn.next_id(), "big-ok")), rpc.Ok)
            assert isinstance(conn.call(rpc.Release(conn.next_id(), "big-ok")), rpc.Ok)
    finally:
        os.unlink(region.path)
    wait_settled(target, lambda: "after the big engine left")
    _unchanged(target)


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def test_block_list_that_cannot_fit_is_refused_before_expansion(target: FuzzTarget) -> None:
    """Regression: 100 logical ids x per_logical 100,000 = 10 million kernel ids.

    The core expands before it checks the range, so this 300-byte request
    used to cost the daemon ~470 MiB and over a second of its event loop.
    """
    tag = uuid.uuid4().hex[:6]
    region = create_shm_file(f"/dev/shm/kvpushd-fuzz-ratio-{tag}", 16 * 256)
    groups = (GroupSpec(GroupKind.ATTENTION, 16, 256, (LayerSpec(region.name),), 100_000),)
    pid = target.prefill.proc.pid
    try:
        with RpcConn(target.prefill.socket) as conn:
            reply = conn.call(rpc.RegisterEngine(conn.next_id(), f"ratio-{tag}", groups, (region,)))
            assert isinstance(reply, rpc.Ok), reply
            peak = peak_rss_kib(pid)
            blocks = (tuple(range(100)),)
            request = rpc.RegisterRequest(conn.next_id(), f"ratio-{tag}", "r", Role.PUSHER, blocks)
            reply = conn.call(request)
            assert isinstance(reply, rpc.Error) and reply.code == "block_out_of_range", reply
            assert "100 blocks of 100000 kernel blocks each" in reply.message, reply
            assert peak_rss_kib(pid) - peak < 100 * 1024
    finally:
        os.unlink(region.path)
    wait_settled(target, lambda: "after the ratio engine left")


def _fuzz_both_listeners(target: FuzzTarget, cases: Any, case: Callable[..., None]) -> None:
    """Cases against the prefill daemon's listener, a few against the decode one's."""
    identity = target.link_identity()
    ran = run_cases(cases, lambda c: case(target, c), scaled(200))
    # The decode daemon listens too (and dials): it turns every dialer away.
    ran += run_cases(cases, lambda c: case(target, c, port=target.decode.port), scaled(30))
    assert ran >= scaled(200)
    assert target.link_identity() == identity, "the real link was replaced"
    _unchanged(target)


def test_peer_random_bytes(target: FuzzTarget) -> None:
    _fuzz_both_listeners(target, peer_streams, peer_stream_case)


def test_peer_messages_before_auth(target: FuzzTarget) -> None:
    _fuzz_both_listeners(target, peer_batches, peer_frames_case)


def test_peer_bad_mac_and_unauthenticated_forward(target: FuzzTarget) -> None:
    """A configured name with a wrong MAC, then a Forward on that unauthenticated link."""
    with PeerConn(target.prefill.port) as conn:
        challenge = conn.challenge()
        mac = auth_mac(b"not the secret", b"dial", challenge.nonce, "decode", "prefill")
        conn.send(peer_frame(pm.Answer("decode", os.urandom(NONCE_BYTES), mac)))
        conn.send(peer_frame(pm.Forward("ghost", 1, "e", ((1,),), 1)))
        messages = conn.finish()
    assert [(type(m), getattr(m, "reason", None)) for m in messages] == [
        (pm.Goodbye, "auth_failed")
    ]
    _unchanged(target)


def test_journal_damaged_bytes(sandbox: JournalSandbox) -> None:
    counts: Counter[str] = Counter()
    ran = run_cases(byte_mutations(), lambda m: journal_bytes_case(sandbox, counts, m), scaled(400))
    assert ran >= scaled(400)
    # The base journal must keep both outcomes reachable, or the oracle tests nothing.
    assert counts["journal_bytes:damage"] and counts["journal_bytes:ok"], counts


def test_journal_mutated_records(sandbox: JournalSandbox) -> None:
    counts: Counter[str] = Counter()
    ran = run_cases(
        record_mutations(), lambda m: journal_records_case(sandbox, counts, m), scaled(300)
    )
    assert ran >= scaled(300)
    assert counts["journal_records:damage"] and counts["journal_records:ok"], counts


def _verify_process(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", "journal", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_journal_verify_cli_never_prints_a_traceback(sandbox: JournalSandbox) -> None:
    """The real command, as a process, on a few kinds of damage: exit 1-2 and no traceback."""
    cases = {
        "torn tail": [("truncate", -1, 0.999, 1, b"x", 0, 0.0)],
        "bit flips": [("flip", 0, 0.5, 3, b"x", 0, 0.0)],
        "garbage": [("garbage", 1, 0.3, 1, b"\xff" * 40, 0, 0.0)],
        "first segment gone": [("delete", 0, 0.0, 1, b"x", 0, 0.0)],
    }
    for name, mutations in cases.items():
        path = sandbox.scratch()
        for mutation in mutations:
            apply_byte_mutation(path, mutation)
        result = _verify_process(path)
        assert result.returncode in (1, 2), (name, result)
        assert "Traceback" not in result.stderr, (name, result.stderr)


def test_journal_verify_cli_on_a_missing_path(tmp_path: Path) -> None:
    result = _verify_process(tmp_path / "nothing-here")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result


async def test_daemons_still_push_after_fuzzing(target: FuzzTarget) -> None:
    await push_once(target, uuid.uuid4().hex[:6])
    wait_settled(target, lambda: "after the push")  # the push's engines detach
    _unchanged(target)
    for daemon in (target.prefill, target.decode):
        assert not error_log_lines(daemon), "\n".join(error_log_lines(daemon)[:5])
        # The operator's view of the journal agrees with the daemon's.
        stats = subprocess.run(
            [
                sys.executable,
                "-m",
                "daemon.cli",
                "journal",
                "stats",
                "--json",
                str(daemon.journal),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[1],
            check=True,
        )
        assert msgspec.json.decode(stats.stdout)["live"] == daemon.status()["live"]
