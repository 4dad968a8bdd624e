"""The differential P/D fuzzer: generated cases through real vLLM and kvpushd, against one instance.

A P/D pair (:class:`Pair`: two daemons and two vLLM servers with
KvpushdConnector, the decode recomputing what it cannot load) and a single
vLLM instance (the oracle) serve the same tiny seeded model. Each batch of
:mod:`harness.pd_cases` runs its cases in threads, each case as a router
would route it (with its fault), while a fault of the system (a daemon
SIGKILLed and started again, or SIGSTOPped a while) may hit the batch.

The oracle, per case: every completed answer, of either leg, equals the
single instance's greedy tokens for the prompt it was sent; a decode leg's
outcome (remote KV, local compute, error, aborted) is one the case allows.
After each batch: both vLLM servers are healthy, hold no KV block within a
bound, both daemons hold no live request, both journals verify, and
``kvpushd journal replay`` finds no anomaly the batch did not cause.

A failure prints one line to reproduce it (seed, case, drawn fields, the
command that reruns that case alone) and is shrunk (:func:`shrink`) to the
smallest variant that still fails.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import http.client
import io
import json
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.sim.launcher import Daemon, free_port
from harness.hostile_params import hostile_legs
from harness.pd_cases import (
    Batch,
    Case,
    Dispatch,
    Model,
    Outcome,
    RouterFault,
    SystemFault,
    allowed,
    is_clean,
    tamper,
)
from harness.pd_cases import shrink as shrink_candidates
from harness.vllm_servers import (
    SERVED_NAME,
    VllmServer,
    VllmServerError,
    kvpushd_connector_config,
    start_servers,
    stop_servers,
    with_tier,
)

# The pair's deadlines are short so that a fault's wait costs seconds:
# a push nobody claims ends after UNCLAIMED_S, any other after REGISTERED_S.
REGISTERED_S = 6.0
UNCLAIMED_S = 2.0
FAILED_S = 8.0
# A batch's leftovers (blocks, live requests) must be gone within this.
SETTLE_S = 25.0
SMALL_POOL_BYTES = 3 << 20
TIMEOUT_S = 120.0
# vLLM's development endpoints: /reset_prefix_cache forgets the cached blocks
# a wrong write may have poisoned, so a failure's shrinking starts clean.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
# The tier shape's pool on each node (a memfd: a daemon killed loses it):
# 256 chunks of one 32-token block of the tiny llama.
TIER_POOL = "\n[offload]\nslots = 256\nslot_bytes = 65536\n"


@dataclass(frozen=True)
class Shape:
    """One P/D layout the fuzzer runs on."""

    name: str
    prefill_tp: int = 1
    decode_tp: int = 1
    staging: bool = False  # both connectors copy through a host mirror
    hybrid: bool = False  # the tiny model with a sliding-window layer
    small_pool: bool = False  # the decode's KV pool holds a few prompts only
    mamba: bool = False  # a tiny Nemotron-H: Mamba state beside attention
    tier: bool = False  # both legs also on their node's offload tier (MultiConnector)

    @property
    def server_args(self) -> tuple[str, ...]:
        """Flags every server of the shape runs with (the oracle's too)."""
        # Recurrent state moves in vLLM's Mamba cache mode "none" only.
        return ("--no-enable-prefix-caching",) if self.mamba else ()


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("tp1"),
        Shape("small-kv", small_pool=True),
        Shape("staging", staging=True),
        Shape("hybrid", hybrid=True),
        Shape("tp2-1", prefill_tp=2),
        Shape("mamba", mamba=True),
        Shape("tier", tier=True),
    )
}


@dataclass
class Pair:
    """Two daemons and two vLLM servers through kvpushd (the system under test)."""

    model: Path
    workdir: Path
    shape: Shape
    prefill: Daemon | None = None
    decode: Daemon | None = None
    p: VllmServer | None = None
    d: VllmServer | None = None
    killed: set[str] = field(default_factory=set)  # nodes SIGKILLed at least once

    def start(self) -> Pair:
        extra = _deadlines() + (TIER_POOL if self.shape.tier else "")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.prefill = Daemon("prefill", self.workdir, free_port(), extra=extra).start()
        self.decode = Daemon("decode", self.workdir, free_port(), extra=extra).start()
        cores = sorted(os.sched_getaffinity(0))
        buffer = {"kv_buffer": "host"} if self.shape.staging else None
        prefill_config = kvpushd_connector_config("kv_producer", self.prefill, buffer)
        decode_config = kvpushd_connector_config(
            "kv_consumer", self.decode, buffer, kv_load_failure_policy="recompute"
        )
        if self.shape.tier:
            prefill_config = with_tier(prefill_config, self.prefill)
            decode_config = with_tier(decode_config, self.decode)
        self.p = VllmServer(
            "P", self.model, self.workdir, core=cores[0], tp=self.shape.prefill_tp, env=DEV_MODE,
            extra_args=["--kv-transfer-config", prefill_config, *self.shape.server_args],
        )  # fmt: skip
        self.d = VllmServer(
            "D", self.model, self.workdir, core=cores[-1], tp=self.shape.decode_tp,
            kv_cache_bytes=SMALL_POOL_BYTES if self.shape.small_pool else 128 << 20, env=DEV_MODE,
            extra_args=["--kv-transfer-config", decode_config, *self.shape.server_args],
        )  # fmt: skip
        try:
            start_servers([self.p, self.d])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_servers([s for s in (self.p, self.d) if s is not None])
        for daemon in (self.prefill, self.decode):
            if daemon is not None:
                with contextlib.suppress(Exception):
                    daemon.stop()

    def forget_cached_blocks(self) -> None:
        """Forget both servers' prefix caches (a wrong write poisons the decode's)."""
        for server in self.servers:
            server.reset_prefix_cache()

    @property
    def servers(self) -> tuple[VllmServer, VllmServer]:
        assert self.p is not None and self.d is not None
        return self.p, self.d

    @property
    def daemons(self) -> tuple[Daemon, Daemon]:
        assert self.prefill is not None and self.decode is not None
        return self.prefill, self.decode


def _deadlines() -> str:
    from schemas.state import Deadlines

    # A receiver whose pusher's final word is lost (its daemon restarted
    # meanwhile) stays quarantined until `failed`: FAILED_S bounds that.
    lines = ["[deadlines]", f"registered = {REGISTERED_S}", f"failed = {FAILED_S}"]
    if "unclaimed" in Deadlines.__struct_fields__:  # older code (a before/after run) lacks it
        lines.append(f"unclaimed = {UNCLAIMED_S}")
    return "\n".join(lines)


# ------------------------------------------------------------ the oracle


class Oracle:
    """A single vLLM instance's greedy answers, asked once per distinct request."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self._answers: dict[str, list[list[int]] | None] = {}

    def answers(self, prompt: list[int], max_tokens: int, **fields: Any) -> list[list[int]] | None:
        """The choices' tokens; None where the instance refuses the request (HTTP 400).

        A refused field (``logprobs`` needs the tokenizer the servers skip)
        must be refused by the prefill leg too, and its decode leg served.
        """
        key = json.dumps([prompt, max_tokens, fields], sort_keys=True)
        if key not in self._answers:
            leg = call(self.server, "oracle", _body(prompt, max_tokens, None, **fields))
            if leg.error is not None and not leg.error.startswith("HTTP 400"):
                raise VllmServerError(f"the oracle failed: {leg.error}")
            self._answers[key] = leg.choices
        return self._answers[key]


# ------------------------------------------------------------ one case


@dataclass
class Leg:
    """One HTTP leg's fate: its tokens (one list per choice), an error, or aborted."""

    name: str
    choices: list[list[int]] | None = None
    params: dict[str, Any] | None = None
    error: str | None = None
    aborted: bool = False


@dataclass
class Finding:
    """A broken guarantee: which case (None: the batch), and what."""

    kind: str
    detail: str
    case: Case | None = None


@dataclass
class CaseRun:
    case: Case
    legs: list[Leg] = field(default_factory=list)
    transfer_id: str | None = None
    # ANSWER_TAMPERED: the field changed, and whether no load may come of it.
    tampered: str | None = None
    must_compute: bool = False


def _body(
    prompt: list[int], max_tokens: int, params: dict[str, Any] | None, **fields: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        **fields,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def call(server: VllmServer, name: str, body: dict[str, Any], request_id: str | None = None) -> Leg:
    """One leg to its end: the choices' tokens and the answer's transfer params, or its error."""
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    conn = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        text = resp.read()
        if resp.status != 200:
            return Leg(name, error=f"HTTP {resp.status}: {text[:300]!r}")
        raw = json.loads(text)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Leg(name, error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    choices = sorted(raw["choices"], key=lambda c: c["index"])
    return Leg(
        name,
        choices=[list(c["token_ids"]) for c in choices],
        params=raw.get("kv_transfer_params") or None,
    )


def abort(server: VllmServer, name: str, body: dict[str, Any], early_s: float | None) -> Leg:
    """A streamed leg whose client goes away: after ``early_s`` unread, or after the first chunk."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT_S)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        if early_s is not None:
            time.sleep(early_s)
        else:
            resp = conn.getresponse()
            resp.readline()
    except (OSError, http.client.HTTPException) as exc:
        return Leg(name, error=f"{type(exc).__name__}: {exc}", aborted=True)
    finally:
        # Closing the socket is the client going away: vLLM aborts the request.
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(2)
        conn.close()
    return Leg(name, aborted=True)


@dataclass
class Context:
    pair: Pair
    oracle: Oracle
    model: Model
    nonce: str  # makes router transfer ids unique across reruns of one case
    # Every case run on this pair (its journals hold them all), by index.
    ran: dict[int, tuple[Case, Batch]] = field(default_factory=dict)
    # ANSWER_TAMPERED cases that get a hostile leg instead (harness/hostile_params.py).
    hostile: bool = False


def hostile_leg(
    ctx: Context, params: dict[str, Any], case: Case
) -> tuple[dict[str, Any], str, bool]:
    """The decode leg's params made hostile (the fuzzer's hostile-params dimension).

    The shape comes from the case's draw (``differs_at``): the same case,
    the same shape. A shape that changes a field the connector reads
    (``kvpushd_*``, the fingerprint) must be computed locally; one that only
    adds what it does not read may still load. vLLM's own API refuses
    integers past 64 bits (an HTTP 400 is not the connector's), so that
    shape is left out; so is the stale transfer id, which every tampered
    leg of a prefill-first case is not.
    """
    _, decode = ctx.pair.daemons
    shapes = [
        (name, change)
        for name, change in hostile_legs(decode.node, decode.address, f"127.0.0.1:{free_port()}")
        if "2**70" not in name and "never had" not in name
    ]
    name, change = shapes[case.differs_at % len(shapes)]
    changed = copy.deepcopy(params)
    change(changed)
    reads = name.startswith(("fingerprint", "split_", "prompt_", "transfer_id", "node", "address"))
    must_compute = reads or name in ("its own node", "version a dict")
    return changed, f"hostile: {name}", must_compute


def run_case(ctx: Context, case: Case) -> CaseRun:
    """Route one case as its router (with its fault) would."""
    p, d = ctx.pair.servers
    prefill_daemon, _ = ctx.pair.daemons
    vocab = ctx.model.vocab_size
    prompt, decode_prompt = case.prompt(vocab), case.decode_prompt(vocab)
    run = CaseRun(case)
    if case.prefix_blocks:
        shared = prompt[: case.prefix_blocks * ctx.model.block_size]
        tail = [(t * 7 + 3) % (vocab - 2) + 2 for t in prompt[: ctx.model.block_size // 2 + 1]]
        run.legs.append(call(d, "prefix", _body(shared + tail, 1, None)))
    pfields = case.prefill_fields()
    pparams: dict[str, Any] = {"do_remote_decode": True}
    if ctx.pair.shape.decode_tp > ctx.pair.shape.prefill_tp:
        pparams["kvpushd_decode_tp"] = ctx.pair.shape.decode_tp
    request_id = f"fz-{ctx.nonce}-{case.index}-{uuid.uuid4().hex[:8]}"
    reused = case.fault is RouterFault.TRANSFER_ID_REUSED
    if case.dispatch is Dispatch.CONCURRENT or reused:
        run.transfer_id = f"xfer-{request_id}"
        pparams["transfer_id"] = run.transfer_id
    pbody = _body(prompt, case.prefill_max_tokens, pparams, **pfields)

    def prefill_leg(name: str = "prefill") -> Leg:
        if case.fault is RouterFault.ABORT_PREFILL_EARLY:
            return abort(p, name, pbody, case.fault_s)
        if case.fault is RouterFault.ABORT_PREFILL_MID:
            return abort(p, name, pbody, None)
        return call(p, name, pbody, request_id)

    def decode_leg(params: dict[str, Any] | None, name: str = "decode") -> Leg:
        if case.fault is RouterFault.ANSWER_TAMPERED and params is not None:
            if ctx.hostile and "kvpushd_fingerprint" in params:  # a prefill's answer
                params, run.tampered, run.must_compute = hostile_leg(ctx, params, case)
            else:
                params, run.tampered, run.must_compute = tamper(params, case.differs_at)
        body = _body(decode_prompt, case.decode_max_tokens, params)
        if case.fault is RouterFault.DECODE_DELAYED:
            time.sleep(REGISTERED_S + case.fault_s)
        if case.fault is RouterFault.ABORT_DECODE_EARLY:
            return abort(d, name, body, case.fault_s)
        if case.fault is RouterFault.ABORT_DECODE_MID:
            return abort(d, name, body, None)
        return call(d, name, body, request_id)

    def decode_legs(params: dict[str, Any] | None) -> list[Leg]:
        if case.fault is RouterFault.DECODE_TWICE_AT_ONCE:
            with ThreadPoolExecutor(2) as pool:
                both = [pool.submit(decode_leg, params, f"decode{i}") for i in (1, 2)]
                return [f.result() for f in both]
        first = decode_leg(params)
        if case.fault is RouterFault.DECODE_TWICE_AFTER:
            return [first, decode_leg(params, "decode-again")]
        return [first]

    if case.dispatch is Dispatch.PREFILL_FIRST:
        if reused:
            with ThreadPoolExecutor(2) as pool:
                legs = [
                    f.result()
                    for f in [pool.submit(prefill_leg, n) for n in ("prefill", "prefill-again")]
                ]
        else:
            legs = [prefill_leg()]
        run.legs += legs
        params = next((leg.params for leg in legs if leg.params), None)
        if params is None:
            return run  # nothing to route: the router answers its client an error
        run.transfer_id = params.get("kvpushd_transfer_id", run.transfer_id)
        run.legs += decode_legs(params)
        return run
    host, _, port = prefill_daemon.address.rpartition(":")
    dparams = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefill_daemon.node,
        "remote_host": host,
        "remote_port": int(port),
        "tp_size": ctx.pair.shape.prefill_tp,
        "pp_size": 1,
        "remote_request_id": request_id,
        "transfer_id": run.transfer_id,
    }
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(prefill_leg)]
        if reused:
            futures.append(pool.submit(prefill_leg, "prefill-again"))
        decoding = pool.submit(decode_legs, dparams)
        run.legs += [f.result() for f in futures] + decoding.result()
    return run


# ------------------------------------------------------------ judging


def judge_case(ctx: Context, run: CaseRun, batch: Batch, loaded: set[str]) -> list[Finding]:
    """Every answer against the oracle; the decode outcome against what the case allows."""
    case = run.case
    vocab = ctx.model.vocab_size
    found: list[Finding] = []
    prompt, max_tokens, fields = prefill_request(ctx, case)
    want_prefill = ctx.oracle.answers(prompt, max_tokens, **fields)
    want_decode = ctx.oracle.answers(case.decode_prompt(vocab), case.decode_max_tokens)
    permitted = allowed(case, batch, ctx.model)
    if run.must_compute:  # never a load from params the connector cannot trust
        permitted -= {Outcome.REMOTE}
    if want_prefill is None:  # vLLM refuses the prefill leg: nothing is pushed
        permitted |= {Outcome.LOCAL}
        if case.dispatch is Dispatch.PREFILL_FIRST:
            permitted |= {Outcome.ABORTED}  # and the router has nothing to route
    decode_legs = [leg for leg in run.legs if leg.name.startswith("decode")]
    outcomes: list[Outcome] = []
    for leg in run.legs:
        if leg.name == "prefix" or leg.aborted:
            continue
        want = want_prefill if leg.name.startswith("prefill") else want_decode
        if leg.error is not None:
            if leg.name.startswith("decode"):
                outcomes.append(Outcome.HTTP_ERROR)
            elif want is not None:  # the single instance answered it
                found.append(Finding("prefill-error", f"{leg.name}: {leg.error}", case))
            continue
        if leg.choices != want:
            found.append(Finding(
                "wrong-tokens",
                f"{leg.name}: got {leg.choices} want {want} (transfer {run.transfer_id})",
                case,
            ))  # fmt: skip
            outcomes.append(Outcome.WRONG)
    remote = run.transfer_id is not None and run.transfer_id in loaded
    if any(leg.aborted for leg in decode_legs) or not decode_legs:
        outcomes.append(Outcome.ABORTED)
    elif not any(o in (Outcome.WRONG, Outcome.HTTP_ERROR) for o in outcomes):
        outcomes.append(Outcome.REMOTE if remote else Outcome.LOCAL)
    for outcome in outcomes:
        if outcome is not Outcome.WRONG and outcome not in permitted:
            found.append(Finding(
                f"outcome-{outcome.value}",
                f"allowed {sorted(o.value for o in permitted)} (transfer {run.transfer_id}"
                + (f", {run.tampered} tampered)" if run.tampered else ")"),
                case,
            ))  # fmt: skip
    return found


def prefill_request(ctx: Context, case: Case) -> tuple[list[int], int, dict[str, Any]]:
    """What the prefill leg computes, as the oracle is asked it: (prompt, max_tokens, fields).

    A model with recurrent state computes its prompt but the last token and
    answers one token of that (the connector cuts it for the decode, which
    applies the last token itself; vLLM's NixlConnector does the same).
    """
    prompt, fields = case.prompt(ctx.model.vocab_size), case.prefill_fields()
    if not ctx.pair.shape.mamba or len(prompt) <= 1:
        return prompt, case.prefill_max_tokens, fields
    if "min_tokens" in fields:
        fields["min_tokens"] = min(int(fields["min_tokens"]), 1)  # type: ignore[call-overload]
    return prompt[:-1], 1, fields


def loaded_transfers(daemon: Daemon) -> set[str]:
    """Transfers whose KV this (decode) daemon received: a write reached done."""
    from daemon.journal.replay import replay
    from schemas.events import WriteDone
    from statemachine.ranks import transfer_of

    out: set[str] = set()

    def collect(record: Any, touched: object) -> None:
        if isinstance(record.event, WriteDone):
            out.add(transfer_of(record.event.request_id))

    replay(daemon.journal, on_record=collect)
    return out


def _cli(*argv: str) -> tuple[int, str]:
    from daemon.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(argv))
    return code, out.getvalue()


# Lists of ``journal replay --json`` that name an anomaly; a killed daemon
# may leave a torn tail and a restart, nothing else.
ANOMALIES = (
    "never_released",
    "disagreements",
    "split_transfers",
    "mismatches",
    "gaps",
    "rejected",
    "damage",
)
AFTER_A_KILL = ("torn", "restarts", "gaps")
# The case a daemon request belongs to: router ids and vLLM's both carry ours.
_CASE_OF = re.compile(r"fz-[0-9a-f]+-(\d+)-")


def excused(entry: Any, ran: dict[int, tuple[Case, Batch]]) -> bool:
    """An anomaly a case caused: two sides that end differently where the case broke something.

    A decode aborted after the push was done, a decode leg sent twice, a
    daemon killed: the sides' outcomes differ and the journal says so; so do
    the TP shares of one transfer that each failed for its own reason (one
    at its deadline, the other cancelled by its peer). Only a clean case's
    (:func:`harness.pd_cases.is_clean`) sides and shares must agree.
    """
    if not isinstance(entry, dict) or not ({"sides", "shares"} & entry.keys()):
        return False
    match = _CASE_OF.search(str(entry.get("request_id") or entry.get("transfer") or ""))
    if match is None or int(match.group(1)) not in ran:
        return False
    return not is_clean(*ran[int(match.group(1))])


def check_system(pair: Pair, ran: dict[int, tuple[Case, Batch]]) -> list[Finding]:
    """After a batch: servers healthy and empty, daemons idle, journals sound."""
    found: list[Finding] = []
    servers, daemons = pair.servers, pair.daemons
    for server in servers:
        if not server.alive():
            return [Finding("server-died", f"{server.name} exited: {server._tail()}")]
    deadline = time.monotonic() + SETTLE_S
    pending = {s.name: s for s in servers}
    live: dict[str, int] = {}
    while time.monotonic() < deadline:
        for name, server in list(pending.items()):
            if server.metrics().total("vllm:kv_cache_usage_perc") == 0:
                del pending[name]
        live = {dm.node: dm.status()["live"] for dm in daemons}
        if not pending and not any(live.values()):
            break
        time.sleep(0.2)
    for name in pending:
        found.append(Finding("kv-leak", f"{name} still holds KV blocks after {SETTLE_S:.0f} s"))
    for node, count in live.items():
        if count:
            requests = next(dm for dm in daemons if dm.node == node).status()["requests"]
            found.append(
                Finding("live-left", f"{node}: {count} live after {SETTLE_S:.0f} s: {requests}")
            )
    for daemon in daemons:
        code, text = _cli("journal", "verify", str(daemon.journal))
        if code != 0 and not (code == 1 and daemon.node in pair.killed):
            found.append(Finding("journal-verify", f"{daemon.node}: exit {code}: {text[-400:]}"))
    code, text = _cli(
        "journal", "replay", "--json", "--limit", "0", *(str(dm.journal) for dm in daemons)
    )
    if code != 0:
        return [*found, Finding("journal-replay", f"exit {code}")]
    report = json.loads(text)
    for key in ANOMALIES:
        if pair.killed and key in AFTER_A_KILL:
            continue
        left = [e for e in report.get(key) or [] if not excused(e, ran)]
        if left:
            found.append(Finding("journal-anomaly", f"{key}: {json.dumps(left)[:600]}"))
    return found


# ------------------------------------------------------------ batches


def system_fault(pair: Pair, batch: Batch, done: threading.Event) -> None:
    """The batch's fault of the system, ``system_at_s`` after it started.

    It happens even when the cases ended first: then it tests recovery of
    an idle pair, which the next batch meets.
    """
    if batch.system is SystemFault.NONE:
        return
    done.wait(batch.system_at_s)
    prefill, decode = pair.daemons
    target = prefill if "prefill" in batch.system.value else decode
    assert target.proc is not None
    if batch.system.value.startswith("kill"):
        target.kill()
        pair.killed.add(target.node)
        target.start()
    else:
        os.kill(target.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(batch.system_for_s)
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)


def wait_engines(pair: Pair, timeout_s: float = 60.0) -> None:
    """Until each daemon knows its engine again (after a restart the connector registers anew)."""
    deadline = time.monotonic() + timeout_s
    for daemon in pair.daemons:
        while not daemon.status()["engines"]:
            if time.monotonic() > deadline:
                raise VllmServerError(f"{daemon.node}: no engine registered again")
            time.sleep(0.2)


def run_batch(ctx: Context, batch: Batch) -> tuple[list[CaseRun], list[Finding]]:
    """Every case of ``batch`` at once (and its fault of the system); then judge all."""
    vocab = ctx.model.vocab_size
    for case in batch.cases:  # the oracle first: it shares a core with the prefill
        prompt, max_tokens, fields = prefill_request(ctx, case)
        ctx.oracle.answers(prompt, max_tokens, **fields)
        ctx.oracle.answers(case.decode_prompt(vocab), case.decode_max_tokens)
    done = threading.Event()
    with ThreadPoolExecutor(len(batch.cases) + 1) as pool:
        fault = pool.submit(system_fault, ctx.pair, batch, done)
        futures = [pool.submit(run_case, ctx, case) for case in batch.cases]
        runs = [f.result() for f in futures]
        done.set()
        fault.result()
    wait_engines(ctx.pair)
    ctx.ran.update({case.index: (case, batch) for case in batch.cases})
    found = check_system(ctx.pair, ctx.ran)
    loaded = loaded_transfers(ctx.pair.daemons[1])
    for run in runs:
        found += judge_case(ctx, run, batch, loaded)
    return runs, found


def reproduce_line(seed: int, shape: str, batch: Batch, finding: Finding, cases: int) -> str:
    where = f"case {finding.case.index}" if finding.case else f"batch {batch.index}"
    drawn = finding.case.line() if finding.case else batch.line()
    rerun = f"make fuzz-vllm SEED={seed} CASES={cases} SHAPES={shape}" + (
        f" ONLY={finding.case.index}" if finding.case else f" ONLY_BATCH={batch.index}"
    )
    head = f"FUZZ FAIL seed={seed} shape={shape} {where}: {finding.kind}: {finding.detail}"
    return f"{head} | {drawn} | {batch.line()} | rerun: {rerun}"


def shrink(
    ctx: Context,
    failing: tuple[Case, Batch],
    still_fails: Callable[[Case, Batch], bool],
    budget: int = 12,
) -> tuple[Case, Batch]:
    """Greedy: the first smaller variant that still fails, until none does or the budget ends."""
    current = failing
    tried = 0
    progress = True
    while progress and tried < budget:
        progress = False
        for candidate in shrink_candidates(*current, ctx.model):
            if candidate == current:
                continue
            tried += 1
            if still_fails(*candidate):
                current = candidate
                progress = True
                break
            if tried >= budget:
                break
    return current


@contextlib.contextmanager
def running_pair(model: Path, workdir: Path, shape: Shape) -> Iterator[Pair]:
    pair = Pair(model, workdir, shape).start()
    try:
        yield pair
    finally:
        pair.stop()


# ------------------------------------------------------------ a run


@dataclass
class Report:
    """What a run did: cases by kind, batches, findings (shrunk), seconds."""

    seed: int
    shape: str
    cases: int = 0
    batches: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def summary(self) -> str:
        per_case = self.seconds / max(1, self.cases)
        return (
            f"pd-fuzz seed={self.seed} shape={self.shape}: {self.cases} cases in {self.batches} "
            f"batches, {self.seconds:.0f} s ({per_case:.2f} s/case), "
            f"{len(self.findings)} findings; kinds {json.dumps(self.by_kind, sort_keys=True)}; "
            f"outcomes {json.dumps(self.outcomes, sort_keys=True)}"
        )


def _tally(
    report: Report, ctx: Context, batch: Batch, runs: list[CaseRun], loaded: set[str]
) -> None:
    report.batches += 1
    report.count(report.by_kind, f"system:{batch.system.value}")
    report.count(report.by_kind, f"in-flight:{'1' if len(batch.cases) == 1 else '2-24'}")
    for run in runs:
        case = run.case
        report.cases += 1
        report.count(report.by_kind, f"fault:{case.fault.value}")
        report.count(report.by_kind, f"dispatch:{case.dispatch.value}")
        report.count(report.by_kind, f"prefill_max_tokens:{case.prefill_max_tokens}")
        if case.prefix_blocks:
            report.count(report.by_kind, "decode-prefix-hit")
        if case.prefill_fields():
            report.count(report.by_kind, "prefill-fields")
        boundary = case.prompt_len % ctx.model.block_size
        edge = {ctx.model.block_size - 1: "k*B-1", 0: "k*B", 1: "k*B+1"}.get(boundary, "other")
        report.count(report.by_kind, f"length:{edge}")
        remote = run.transfer_id is not None and run.transfer_id in loaded
        report.count(report.outcomes, "remote" if remote else "local-or-aborted")


def fuzz(
    model: Path,
    workdir: Path,
    shape: Shape,
    batches: list[Batch],
    oracle: VllmServer,
    *,
    seed: int,
    total: int,
    shrink_budget: int = 12,
    log: Callable[[str], None] = print,
    hostile: bool = False,
) -> Report:
    """``batches`` on a fresh pair of ``shape``; each failure printed, shrunk, printed again."""
    report = Report(seed, shape.name)
    started = time.monotonic()
    the_model = _model_of(oracle)
    small = [b if not shape.small_pool else _small(b) for b in batches]
    stack = contextlib.ExitStack()
    pair = stack.enter_context(running_pair(model, workdir / "pair-0", shape))
    ctx = Context(pair, Oracle(oracle), the_model, uuid.uuid4().hex[:6], hostile=hostile)
    restarts = 0

    def restart() -> None:
        nonlocal restarts
        restarts += 1
        stack.close()
        ctx.pair = stack.enter_context(running_pair(model, workdir / f"pair-{restarts}", shape))
        ctx.ran = {}

    def clean_up(found: list[Finding]) -> None:
        """A leak or a dead server: a fresh pair; a wrong answer: no cached block survives."""
        if any(f.case is None for f in found):
            restart()
        elif found:
            ctx.pair.forget_cached_blocks()

    def fails(case: Case, batch: Batch) -> bool:
        ctx.nonce = uuid.uuid4().hex[:6]
        _, found = run_batch(ctx, batch)
        clean_up(found)
        if found:
            log(f"  still fails: {found[0].kind}: {found[0].detail[:200]} | {case.line()}")
        return bool(found)

    def culprit(batch: Batch, budget: int) -> Case | None:
        """The first case of a batch that fails alone (a batch-wide finding names none)."""
        suspects = sorted(batch.cases, key=lambda c: c.fault is RouterFault.NONE)
        for case in suspects[:budget]:
            if fails(case, dataclasses.replace(batch, cases=(case,))):
                return case
        return None

    try:
        for batch in small:
            batch_started = time.monotonic()
            runs, found = run_batch(ctx, batch)
            log(
                f"batch {batch.index}: {len(batch.cases)} cases, {batch.system.value}, "
                f"{time.monotonic() - batch_started:.1f} s, {len(found)} findings"
            )
            _tally(report, ctx, batch, runs, loaded_transfers(ctx.pair.daemons[1]))
            if not found:
                continue
            for finding in found:
                line = reproduce_line(seed, shape.name, batch, finding, total)
                line += " HOSTILE=1" if hostile else ""
                report.findings.append(line)
                log(line)
            clean_up(found)
            first = next((f.case for f in found if f.case is not None), None)
            if first is None and shrink_budget:
                first = culprit(batch, shrink_budget)
            if shrink_budget and first is not None:
                case, smallest = shrink(ctx, (first, batch), fails, shrink_budget)
                log(f"SHRUNK seed={seed} shape={shape.name}: {case.line()} | {smallest.line()}")
                report.findings.append(f"shrunk: {case.line()} | {smallest.line()}")
    finally:
        stack.close()
        report.seconds = time.monotonic() - started
    return report


def _small(batch: Batch) -> Batch:
    return dataclasses.replace(batch, small_pool=True)


def _model_of(server: VllmServer) -> Model:
    config = json.loads((server.model / "config.json").read_text())
    window = int(config.get("sliding_window") or 0)
    return Model(server.block_size, server.max_model_len, int(config["vocab_size"]), window)
