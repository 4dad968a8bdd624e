"""The node's offload tier serving real vLLM: stored in the daemon's pool, found again by content.

One daemon with a pool (a file under /dev/shm, so it outlives the daemon)
and two plain instances of one model on it (``KvpushdOffloadingConnector``),
each with an engine prefix cache too small to keep what it computed. The
oracle of every prompt is the same instance asked with
``kv_load_tiers: []`` (vLLM's per-request tier filter: this tier is not
read), after its own prefix cache was reset: what it computes alone.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.journal.replay import replay
from daemon.sim.launcher import Daemon, free_port
from harness.tinyllama import write_tinyllama
from harness.vllm_servers import VllmServer, kvpushd_tier_config, running, start_servers
from statemachine.slots import SlotState

TOKENS = 8
BLOCK = 32
SLOT_BYTES = 64 * 1024  # one block of the tiny llama: 2 layers x 2 heads x 32 tokens x 128 x 4
SLOTS = 96
# Room for about 40 blocks: a conversation's turns do not all stay.
KV_CACHE_BYTES = 40 * SLOT_BYTES
# vLLM's prompt tokens by where they came from; a load from this tier is an external one.
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
EXTERNAL = {"source": "external_kv_transfer"}
NO_TIER = {"kv_transfer_params": {"kv_load_tiers": []}}

Node = tuple[VllmServer, VllmServer, Daemon]


def _server(name: str, model: Path, workdir: Path, daemon: Daemon, core: int) -> VllmServer:
    return VllmServer(
        name, model, workdir, core=core, kv_cache_bytes=KV_CACHE_BYTES,
        env={"VLLM_SERVER_DEV_MODE": "1"},
        extra_args=["--kv-transfer-config", kvpushd_tier_config(daemon)],
    )  # fmt: skip


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    model = write_tinyllama(tmp_path_factory.mktemp("tier-llama"))
    workdir = tmp_path_factory.mktemp("tier")
    pool = Path("/dev/shm") / f"kvpushd-test-pool-{uuid.uuid4().hex[:8]}"
    offload = f'[offload]\nslots = {SLOTS}\nslot_bytes = {SLOT_BYTES}\npath = "{pool}"'
    daemon = Daemon("tier", workdir, free_port(), extra=offload).start()
    cores = sorted(os.sched_getaffinity(0))
    a = _server("A", model, workdir, daemon, cores[0])
    b = _server("B", model, workdir, daemon, cores[-1])
    try:
        with running(a, b):
            yield a, b, daemon
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
        pool.unlink(missing_ok=True)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(length)]


def _alone(server: VllmServer, prompt: list[int], tokens: int = TOKENS) -> list[int]:
    """What ``server`` computes for ``prompt`` without the tier or its own cache."""
    server.reset_prefix_cache()
    return server.complete(prompt, tokens, **NO_TIER).token_ids


def _external(server: VllmServer) -> float:
    return server.metrics().total(BY_SOURCE, **EXTERNAL)


def _restart(server: VllmServer) -> None:
    server.stop()
    server.proc = None
    start_servers([server])


def _stored(server: VllmServer, daemon: Daemon, before: int, at_least: int = 4) -> None:
    """Wait until ``at_least`` more chunks than ``before`` are committed.

    vLLM's offloading connector submits a step's stores at the start of the
    next step: one more short request makes sure that step happens.
    """
    server.complete([5, 6, 7], 1)
    deadline = time.monotonic() + 30
    while len(_committed(daemon)) < before + at_least:
        assert time.monotonic() < deadline, "the stores were not committed"
        time.sleep(0.2)


def _committed(daemon: Daemon) -> list[int]:
    slots = replay(daemon.journal).registry.slots
    readable = (SlotState.COMMITTED, SlotState.LEASED)
    return [slot for slot in range(slots.size) if slots.state(slot) in readable]


def test_a_repeated_prompt_after_a_prefix_cache_reset_is_served_from_the_tier(node: Node) -> None:
    a, _, _ = node
    rng = random.Random(1)
    prompt = _prompt(rng, 200)
    first = a.complete(prompt, TOKENS).token_ids  # computed; its 6 full blocks stored
    a.reset_prefix_cache()
    before = _external(a)
    again = a.complete(prompt, TOKENS).token_ids
    loaded = _external(a) - before
    assert again == first
    assert loaded >= 5 * BLOCK, loaded
    assert _alone(a, prompt) == first


def test_a_second_engine_on_the_node_hits_what_the_first_stored(node: Node) -> None:
    a, b, _ = node
    rng = random.Random(2)
    prompt = _prompt(rng, 170)
    first = a.complete(prompt, TOKENS).token_ids
    before = _external(b)
    got = b.complete(prompt, TOKENS).token_ids
    assert _external(b) - before >= 4 * BLOCK
    assert got == first == _alone(b, prompt)


def test_multi_turn_conversations_are_token_exact_with_the_tier(node: Node) -> None:
    """Each turn extends the last; four conversations interleaved outgrow both engines' caches."""
    a, b, _ = node
    rng = random.Random(3)
    talks = [_prompt(rng, 60 + 7 * i) for i in range(4)]
    before = _external(a) + _external(b)
    for turn in range(4):
        for i, talk in enumerate(talks):
            server = (a, b)[(turn + i) % 2]
            answer = server.complete(talk, TOKENS).token_ids
            assert answer == _alone(server, talk), (turn, i, len(talk))
            talk += answer + _prompt(rng, 40)
    assert _external(a) + _external(b) - before > 0


def test_a_chunk_written_after_its_commit_is_never_served(node: Node) -> None:
    """Every committed slot overwritten in place: the loads' digests fail, vLLM recomputes."""
    a, _, daemon = node
    from daemon.client.pool import attach_pool

    rng = random.Random(4)
    prompt = _prompt(rng, 130)
    first = a.complete(prompt, TOKENS).token_ids
    committed = _committed(daemon)
    assert len(committed) >= 4
    pool = attach_pool(daemon.socket, "test-writer")
    try:
        for slot in committed:
            pool.view(slot)[:SLOT_BYTES] = bytes([7]) * SLOT_BYTES
    finally:
        pool.close()
    a.reset_prefix_cache()
    assert a.complete(prompt, TOKENS).token_ids == first
    assert "is not the chunk committed there" in a.log.read_text()


def test_an_engine_restarted_hits_again(node: Node) -> None:
    a, _, daemon = node
    rng = random.Random(5)
    prompt = _prompt(rng, 150)
    before = len(_committed(daemon))
    first = a.complete(prompt, TOKENS).token_ids
    _stored(a, daemon, before)
    _restart(a)
    before = _external(a)
    assert a.complete(prompt, TOKENS).token_ids == first
    assert _external(a) - before >= 4 * BLOCK


def test_a_daemon_killed_under_load_costs_no_wrong_token_and_its_pool_hits_after(
    node: Node,
) -> None:
    """SIGKILL while both engines store and load; the pool file outlives the daemon."""
    a, b, daemon = node
    rng = random.Random(6)
    prompts = [_prompt(rng, 100 + 9 * i) for i in range(6)]
    expected = [_alone(a, prompt) for prompt in prompts]
    wrong: list[tuple[str, int]] = []

    def load(server: VllmServer, rounds: int) -> None:
        for _ in range(rounds):
            for i, prompt in enumerate(prompts):
                if server.complete(prompt, TOKENS).token_ids != expected[i]:
                    wrong.append((server.name, i))
            server.reset_prefix_cache()

    loaders = [threading.Thread(target=load, args=(s, 3)) for s in (a, b)]
    for loader in loaders:
        loader.start()
    daemon.kill()
    daemon.start()
    for loader in loaders:
        loader.join(timeout=300)
    assert not wrong
    # After the restart the tier serves again: stored anew or kept in the pool.
    a.complete(prompts[0], TOKENS)
    b.reset_prefix_cache()
    before = _external(b)
    assert b.complete(prompts[0], TOKENS).token_ids == expected[0]
    assert _external(b) - before >= 3 * BLOCK
