"""Real vLLM OpenAI servers as subprocesses: start, pin, wait, complete, read metrics, stop.

The one way tests_vllm/ and benches run real vLLM. This module never
imports vLLM: it starts ``python -m vllm.entrypoints.openai.api_server``
with an interpreter that has it (by default this one if vLLM is installed
here, else the repository's ``.venv-vllm``) and speaks HTTP with the
standard library.

What a :class:`VllmServer` does, following /work/shared/VLLM-CPU.md's traps:

- ``--skip-tokenizer-init``: prompts are token ids and answers are token ids
  (``"return_token_ids": true``); ``HF_HUB_OFFLINE=1``, nothing is fetched.
- Pinned to one core: ``VLLM_CPU_OMP_THREADS_BIND`` pins the OpenMP threads,
  the process is started with that one core as its affinity (inherited by
  every thread and by the engine-core and worker processes it spawns), and
  :meth:`VllmServer.pin` pins every thread of the whole process tree again
  once it is healthy and after warm-up (a busy-polling thread on the other
  instance's core slows both by an order of magnitude).
- The KV cache is sized in bytes (``--kv-cache-memory-bytes``), not as a
  fraction of memory: vLLM's CPU worker subtracts its own resident memory
  (~0.8 GB here) from ``gpu_memory_utilization`` times the NUMA node's memory,
  and 0.05 of this machine's node is less than that, so it refuses to start.
  An explicit size also lets an eager server skip vLLM's warm-up pass.
- ``--enforce-eager`` by default: start-up ~25 s instead of ~50 s (no
  torch.compile); every instance of a test runs the same mode, so greedy
  tokens stay comparable across instances. ``eager=False`` for benches.
- ``block_size`` a multiple of 16 (CPU attention takes 32k, its MLA backend 16).

Files of a server named ``N`` in its work folder ``W``: ``W/N.log`` (its
stdout and stderr, with every process's lines).
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from daemon.sim.launcher import free_port

# The checkout this harness lives in (harness/ is never installed): where
# ``.venv-vllm`` is.
REPO: Final = Path(__file__).resolve().parents[1]
# The name every server serves its model under (requests name it).
SERVED_NAME: Final = "tiny"
# Prompt tokens by where they came from (label ``source``: local_compute,
# local_cache_hit, external_kv_transfer): how a test tells a load from a recompute.
EXTERNAL_TOKENS: Final = "vllm:prompt_tokens_by_source_total"
DEFAULT_KV_CACHE_BYTES: Final = 128 << 20


class VllmServerError(RuntimeError):
    """A server did not start, answered an error, or did not stop; the message ends with its log."""


def default_python() -> str:
    """An interpreter with vLLM: this one if it has vLLM, else the repository's ``.venv-vllm``."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return str(REPO / ".venv-vllm" / "bin" / "python")


@dataclass(frozen=True)
class Completion:
    """One ``/v1/completions`` answer, reduced to what tests compare."""

    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    elapsed_s: float
    raw: dict[str, Any]


@dataclass(frozen=True)
class Streamed:
    """One streamed ``/v1/completions`` answer: its tokens and when the first came."""

    token_ids: list[int]
    first_token_s: float
    elapsed_s: float


@dataclass
class VllmServer:
    """One vLLM OpenAI API server subprocess and the files it uses."""

    name: str
    model: Path
    workdir: Path
    core: int | None = None
    port: int = field(default_factory=free_port)
    block_size: int = 32
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_model_len: int = 1024
    max_num_seqs: int = 16
    # Tensor-parallel ranks, pipeline stages and data-parallel engines
    # (processes), all on ``core``.
    tp: int = 1
    pp: int = 1
    dp: int = 1
    eager: bool = True
    seed: int = 0
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    python: str = field(default_factory=default_python)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    healthy_after_s: float | None = None
    # A host of its own (daemon/sim/hosts.py): the server runs in ``netns``
    # and listens on ``host`` there; this process reaches it from the
    # network namespace ``client_netns`` (a router host), each call made
    # from there (None: this process's own).
    netns: str | None = None
    host: str = "127.0.0.1"
    client_netns: str | None = None

    def __post_init__(self) -> None:
        # vLLM's CPU attention needs a multiple of 32; its MLA backend forces 16.
        if self.block_size % 16:
            raise ValueError(
                f"block_size {self.block_size}: vLLM's CPU attention needs a multiple of 16"
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    # ------------------------------------------------------------ process

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--model",
            str(self.model),
            "--served-model-name",
            SERVED_NAME,
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--seed",
            str(self.seed),
            "--block-size",
            str(self.block_size),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--disable-uvicorn-access-log",
        ]
        if self.eager:
            cmd.append("--enforce-eager")
        if self.tp > 1:
            cmd += ["--tensor-parallel-size", str(self.tp)]
        if self.pp > 1:
            cmd += ["--pipeline-parallel-size", str(self.pp)]
        if self.dp > 1:
            cmd += ["--data-parallel-size", str(self.dp)]
        return [*cmd, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        if self.core is not None:
            # One core list per rank (TP x PP x DP), separated by "|": every rank on the one core.
            ranks = self.tp * self.pp * self.dp
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join([str(self.core)] * ranks)
        env.update(self.env)
        return env

    def start(self) -> None:
        """Start the server (returns at once; :meth:`wait_healthy` waits for it)."""
        if self.proc is not None:
            raise VllmServerError(f"{self.name} already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        core = self.core

        def before_exec() -> None:
            _die_with_parent()
            if core is not None:
                os.sched_setaffinity(0, {core})

        argv = self.command()
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, *argv]  # execs: the pid is the server's
        with self.log.open("ab") as out:
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=before_exec,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        """Poll ``/health`` until it answers 200; the seconds since :meth:`start`."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = None if self.proc is None else self.proc.returncode
                raise VllmServerError(f"{self.name} exited ({code}) before healthy" + self._tail())
            with (
                contextlib.suppress(OSError),
                self.client(),
                urllib.request.urlopen(self.url + "/health", timeout=2) as resp,
            ):
                if resp.status == 200:
                    self.healthy_after_s = time.monotonic() - self.started_at
                    return self.healthy_after_s
            if time.monotonic() > deadline:
                raise VllmServerError(
                    f"{self.name} not healthy after {timeout_s:.0f} s" + self._tail()
                )
            time.sleep(0.2)

    def pids(self) -> list[int]:
        """The server's process and every descendant (engine core, worker, helpers)."""
        if self.proc is None:
            return []
        return process_tree(self.proc.pid)

    def pin(self) -> int:
        """Pin every thread of every process of the server to its core; how many were pinned."""
        if self.core is None:
            return 0
        return pin_threads(self.pids(), self.core)

    def warm_up(self, prompt_len: int = 64, max_tokens: int = 4) -> Completion:
        """One request (the first of a process is slow), then pin again."""
        done = self.complete(list(range(2, 2 + prompt_len)), max_tokens)
        self.pin()
        return done

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout_s``; its exit code.

        Whatever of the group is still there after the server exits (a
        helper that missed the shutdown) is killed too, and waited for.
        """
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        # Then wait for the group to be gone (reaped by init), so that a
        # caller that checks for leftovers right after sees none.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        return proc.returncode

    def _tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last lines of {self.log}:\n" + "\n".join(text)

    # ------------------------------------------------------------ HTTP

    def complete(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        timeout_s: float = 120.0,
        dp_rank: int | None = None,
        **fields: Any,
    ) -> Completion:
        """Greedy ``/v1/completions`` of a token-id prompt, running exactly ``max_tokens``.

        ``fields`` add to or override the request body (e.g.
        ``kv_transfer_params``); ``request_id`` is sent as ``X-Request-Id``,
        ``dp_rank`` as ``X-data-parallel-rank`` (the DP engine to serve it).
        """
        body, headers = _completion(prompt, max_tokens, request_id, fields, dp_rank)
        started = time.monotonic()
        raw = self._post("/v1/completions", body, headers, timeout_s)
        elapsed = time.monotonic() - started
        choice = raw["choices"][0]
        return Completion(
            token_ids=list(choice["token_ids"]),
            prompt_token_ids=list(choice.get("prompt_token_ids") or []),
            finish_reason=choice.get("finish_reason"),
            elapsed_s=elapsed,
            raw=raw,
        )

    def stream(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        timeout_s: float = 120.0,
        dp_rank: int | None = None,
        **fields: Any,
    ) -> Streamed:
        """:meth:`complete`, streamed: also when the first token came (a TTFT)."""
        body, headers = _completion(
            prompt, max_tokens, request_id, {**fields, "stream": True}, dp_rank
        )
        started = time.monotonic()
        with self.client():  # the socket belongs to the namespace it was opened in
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
            conn.connect()
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                detail = resp.read().decode(errors="replace")
                raise VllmServerError(f"{self.name} stream: HTTP {resp.status}: {detail}")
            tokens: list[int] = []
            first: float | None = None
            for line in resp:
                data = line.strip().removeprefix(b"data:").strip()
                if not data or data == line.strip() or data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise VllmServerError(f"{self.name} stream: {chunk['error']}")
                ids = chunk["choices"][0].get("token_ids") or []
                if ids and first is None:
                    first = time.monotonic() - started
                tokens.extend(ids)
        finally:
            conn.close()
        if first is None:
            raise VllmServerError(f"{self.name} stream: no token came")
        return Streamed(tokens, first, time.monotonic() - started)

    def pause(self) -> None:
        """SIGSTOP the whole server (a bench measures another one meanwhile)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def client(self) -> contextlib.AbstractContextManager[None]:
        """Where this process's calls to the server come from (see ``client_netns``)."""
        if self.client_netns is None:
            return contextlib.nullcontext()
        from daemon.sim.hosts import entered

        return entered(self.client_netns)

    def wait_kv_usage_zero(self, timeout_s: float = 10.0) -> None:
        """Wait until vLLM holds no KV block (``vllm:kv_cache_usage_perc`` 0), or fail."""
        deadline = time.monotonic() + timeout_s
        while self.metrics().total("vllm:kv_cache_usage_perc") > 0:
            assert time.monotonic() < deadline, f"{self.name} still holds KV blocks"
            time.sleep(0.2)

    def reset_prefix_cache(self, timeout_s: float = 30.0) -> None:
        """Forget the engine's own cached blocks (vLLM's development endpoint:
        the server needs ``VLLM_SERVER_DEV_MODE=1``); a connector's cache stays."""
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        try:
            with self.client(), urllib.request.urlopen(req, timeout=timeout_s) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            raise VllmServerError(f"{self.name}: reset_prefix_cache: HTTP {e.code}") from e

    def metrics(self, timeout_s: float = 10.0) -> Metrics:
        url = self.url + "/metrics"
        with self.client(), urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return Metrics.parse(resp.read().decode())

    def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float
    ) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with self.client(), urllib.request.urlopen(req, timeout=timeout_s) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
                return answer
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise VllmServerError(f"{self.name} {path}: HTTP {e.code}: {detail}") from e


def _completion(
    prompt: Sequence[int],
    max_tokens: int,
    request_id: str | None,
    fields: dict[str, Any],
    dp_rank: int | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The body and headers of a greedy token-id completion."""
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": [int(t) for t in prompt],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    if dp_rank is not None:
        headers["X-data-parallel-rank"] = str(dp_rank)
    return body, headers


# vLLM's own NIXL connectors: push (pairs the two sides by the router's
# ``X-Request-Id``) and pull (the decode reads the prefill's blocks).
NIXL_PUSH, NIXL_PULL = "NixlPushConnector", "NixlConnector"


def nixl_connector_config(connector: str = NIXL_PUSH, **more: Any) -> str:
    """``--kv-transfer-config`` for one of vLLM's own NIXL connectors over host memory.

    Each server also needs its own ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (see
    :func:`nixl_pd`); for the push connector a router sends the same
    ``X-Request-Id`` to both servers.
    """
    return json.dumps(
        {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu", **more}
    )


def kvpushd_connector_config(
    role: str, daemon: Any, extra_config: dict[str, Any] | None = None, **more: Any
) -> str:
    """``--kv-transfer-config`` for a server using KvpushdConnector beside ``daemon``.

    ``daemon`` is a :class:`daemon.sim.launcher.Daemon`; ``role`` is vLLM's
    ``kv_role``; ``extra_config`` adds connector settings
    (``hold_every_s``...), ``more`` top-level fields (``kv_load_failure_policy``...).
    """
    return json.dumps(
        {
            "kv_connector": "KvpushdConnector",
            "kv_connector_module_path": "daemon.client.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {
                "socket": daemon.socket,
                "node": daemon.node,
                "address": daemon.address,
                **(extra_config or {}),
            },
            **more,
        }
    )


def kvpushd_tier_config(daemon: Any, extra_config: dict[str, Any] | None = None) -> str:
    """``--kv-transfer-config`` for a plain server on the node's offload tier of ``daemon``.

    One offloaded chunk per vLLM block (``block_size`` 32, the servers'),
    and a load that fails its digest recomputed.
    """
    return json.dumps(
        {
            "kv_connector": "KvpushdOffloadingConnector",
            "kv_connector_module_path": "daemon.client.vllm.tier",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "socket": daemon.socket,
                "block_size": 32,
                **(extra_config or {}),
            },
        }
    )


def with_tier(kvpushd_config: str, daemon: Any) -> str:
    """``kvpushd_config`` (a KvpushdConnector's) beside the node's offload tier of ``daemon``:
    vLLM's MultiConnector over both, the push connector first (it loads a P/D
    request's KV; the tier loads what it holds of any other)."""
    push = json.loads(kvpushd_config)
    tier = json.loads(kvpushd_tier_config(daemon))
    return json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": push["kv_role"],
            **{k: v for k, v in push.items() if k == "kv_load_failure_policy"},
            "kv_connector_extra_config": {"connectors": [push, tier]},
        }
    )


# ------------------------------------------------------------ several servers


def start_servers(
    servers: Sequence[VllmServer], timeout_s: float = 240.0, warm_up: bool = True
) -> None:
    """Start every server at once, wait until all are healthy, pin, warm up, pin again.

    On any failure every server is stopped before the error propagates.
    """
    ports = [s.port for s in servers]
    if len(set(ports)) != len(ports):
        raise ValueError(f"servers share a port: {ports}")
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy(timeout_s)
            server.pin()
        if warm_up:
            for server in servers:
                server.warm_up()
    except BaseException:
        stop_servers(servers)
        raise


def stop_servers(servers: Iterable[VllmServer]) -> None:
    for server in servers:
        server.stop()


@contextlib.contextmanager
def running(*servers: VllmServer, timeout_s: float = 240.0) -> Iterator[tuple[VllmServer, ...]]:
    """``with running(a, b):`` starts both (:func:`start_servers`) and stops both after."""
    start_servers(servers, timeout_s)
    try:
        yield servers
    finally:
        stop_servers(servers)


@contextlib.contextmanager
def kvpushd_pd(
    model: Path,
    workdir: Path,
    *,
    prefill_env: dict[str, str] | None = None,
    decode_env: dict[str, str] | None = None,
    eager: bool = True,
    prefill_model: Path | None = None,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    prefill_pp: int = 1,
    decode_pp: int = 1,
    prefill_dp: int = 1,
    decode_dp: int = 1,
    prefill_block_size: int = 32,
    decode_block_size: int = 32,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    prefill_role: str = "kv_producer",
    decode_role: str = "kv_consumer",
    prefill_daemon_extra: str = "",
    decode_daemon_extra: str = "",
    decode_kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
    decode_extra_config: dict[str, Any] | None = None,
    decode_server_env: dict[str, str] | None = None,
    prefill_server_env: dict[str, str] | None = None,
    prefill_extra_config: dict[str, Any] | None = None,
    hosts: Any = None,
    between_starts: Callable[[VllmServer], None] | None = None,
    **decode_config: Any,
) -> Iterator[tuple[VllmServer, VllmServer, Any, Any]]:
    """A prefill/decode pair through kvpushd: two daemons (no ``[[peers]]``), two servers.

    Yields (prefill server, decode server, prefill daemon, decode daemon).
    The servers sit on the first and the last core this process may use;
    ``decode_config`` adds top-level fields to the decode's connector config
    (``kv_load_failure_policy``), ``prefill_env`` to the prefill daemon's
    environment (``KVPUSHD_FAILPOINTS``), ``decode_env`` to the decode
    daemon's; ``prefill_model`` serves other
    weights on the prefill side (default: ``model`` on both);
    ``prefill_tp`` and ``decode_tp`` are the servers' tensor-parallel sizes,
    ``prefill_pp`` and ``decode_pp`` their pipeline stages (a server with
    stages runs compiled: vllm-cpu serves PP only so), ``prefill_dp`` and
    ``decode_dp`` their data-parallel engines, ``prefill_block_size`` and
    ``decode_block_size`` their KV block sizes, ``prefill_args`` and
    ``decode_args`` more of their command-line flags (``--kv-cache-dtype``),
    ``prefill_role`` and ``decode_role`` their ``kv_role`` (``kv_both``: each
    serves either leg);
    ``prefill_daemon_extra`` adds lines to the prefill daemon's config
    (``[deadlines]``...), ``decode_daemon_extra`` the decode daemon's;
    ``decode_kv_cache_bytes`` sizes the decode's KV
    cache, ``decode_extra_config`` adds its connector settings,
    ``decode_server_env`` to the decode vLLM server's environment (the
    connector's ``KVPUSHD_FAILPOINTS``), ``prefill_server_env`` the prefill
    vLLM server's, ``prefill_extra_config`` the
    prefill's connector settings (``kv_buffer``); ``hosts`` (a
    :class:`daemon.sim.hosts.Hosts` with hosts ``router``, ``prefill`` and
    ``decode``) puts each daemon and its server on its own host, UCX over
    TCP, and makes this process's calls to the servers from the router
    host; ``between_starts`` runs with the prefill server once it is
    healthy and before the decode server starts (a checkpoint or an adapter
    rewritten in place between the two, as a rolling upgrade does); the shared-memory
    segments servers of several ranks leave behind are removed after.
    The decode daemon dials the prefill's on demand. On exit the servers
    stop, then both daemons (one killed by the caller stays killed); a daemon
    that does not stop with 0 is an error.
    """
    from daemon.sim.launcher import Daemon

    workdir.mkdir(parents=True, exist_ok=True)
    where: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
    served: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
    if hosts is not None:
        from daemon.sim.hosts import UCX_TCP

        for name in where:
            host = hosts[name]
            where[name] = {"netns": host.netns, "host": host.address}
            served[name] = {**where[name], "client_netns": hosts["router"].netns}
    prefill = Daemon(
        "prefill", workdir, free_port(), extra=prefill_daemon_extra,
        env={**(UCX_TCP if hosts else {}), **(prefill_env or {})}, **where["prefill"],
    ).start()  # fmt: skip
    decode = Daemon(
        "decode", workdir, free_port(), extra=decode_daemon_extra,
        env={**(UCX_TCP if hosts else {}), **(decode_env or {})}, **where["decode"],
    ).start()  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))
    shm_before = vllm_shm_segments()
    p = VllmServer(
        "P", prefill_model or model, workdir, core=cores[0], eager=eager and prefill_pp == 1,
        tp=prefill_tp, pp=prefill_pp, dp=prefill_dp, block_size=prefill_block_size,
        env=prefill_server_env or {}, **served["prefill"],
        extra_args=[
            "--kv-transfer-config",
            kvpushd_connector_config(prefill_role, prefill, prefill_extra_config),
            *prefill_args,
        ],
    )  # fmt: skip
    d = VllmServer(
        "D", model, workdir, core=cores[-1], eager=eager and decode_pp == 1,
        tp=decode_tp, pp=decode_pp, dp=decode_dp, block_size=decode_block_size,
        kv_cache_bytes=decode_kv_cache_bytes, env=decode_server_env or {}, **served["decode"],
        extra_args=[
            "--kv-transfer-config",
            kvpushd_connector_config(decode_role, decode, decode_extra_config, **decode_config),
            *decode_args,
        ],
    )  # fmt: skip
    try:
        if between_starts is None:
            with running(p, d):
                yield p, d, prefill, decode
        else:
            with running(p), _then(lambda: between_starts(p)), running(d):
                yield p, d, prefill, decode
    finally:
        codes = {
            daemon.node: daemon.stop()
            for daemon in (prefill, decode)
            if daemon.proc is not None and daemon.proc.poll() is None
        }
        if max(prefill_tp, decode_tp, prefill_pp, decode_pp, prefill_dp, decode_dp) > 1:
            remove_vllm_shm_segments(vllm_shm_segments() - shm_before)
        bad = {node: code for node, code in codes.items() if code != 0}
        if bad:
            raise VllmServerError(f"daemons did not stop cleanly: {bad}")


@contextlib.contextmanager
def _then(step: Callable[[], None]) -> Iterator[None]:
    step()
    yield


def vllm_shm_segments() -> set[str]:
    """vLLM's shared-memory files in /dev/shm (a TP instance leaves its all-reduce's behind)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("vllm_")}


def remove_vllm_shm_segments(names: Iterable[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


@contextlib.contextmanager
def nixl_pd(
    model: Path,
    workdir: Path,
    *,
    connector: str = NIXL_PUSH,
    eager: bool = True,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    block_size: int = 32,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[tuple[VllmServer, VllmServer]]:
    """vLLM's own P/D anchor: one of its NIXL connectors on both servers, one core each.

    Yields (prefill server, decode server); no daemon is involved.
    ``block_size``, ``args`` (more flags) and ``env`` apply to both servers.
    """
    cores = sorted(os.sched_getaffinity(0))
    shm_before = vllm_shm_segments()
    tag = "nixl" if connector == NIXL_PUSH else "pull"
    servers = [
        VllmServer(
            f"{tag}-{name}", model, workdir / tag, core=core, eager=eager, tp=tp,
            block_size=block_size,
            extra_args=["--kv-transfer-config", nixl_connector_config(connector), *args],
            env={**(env or {}), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        )
        for name, core, tp in (("P", cores[0], prefill_tp), ("D", cores[-1], decode_tp))
    ]  # fmt: skip
    try:
        with running(*servers):
            yield servers[0], servers[1]
    finally:
        if max(prefill_tp, decode_tp) > 1:
            remove_vllm_shm_segments(vllm_shm_segments() - shm_before)


# ------------------------------------------------------------ metrics


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Metrics:
    """Samples of a Prometheus text exposition: (name, sorted labels) -> value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, value = match.groups()
            pairs = tuple(sorted((k, _unescape(v)) for k, v in _LABEL.findall(labels or "")))
            samples[(name, pairs)] = float(value)
        return cls(samples)

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0.0 if none)."""
        want = set(labels.items())
        return sum(
            value for (n, pairs), value in self.samples.items() if n == name and want <= set(pairs)
        )

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


# ------------------------------------------------------------ /proc


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, from ``/proc/PID/task/TID/children``."""
    found = [root]
    i = 0
    while i < len(found):
        pid = found[i]
        i += 1
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                    found.extend(int(c) for c in f.read().split() if int(c) not in found)
    return found


def pin_threads(pids: Iterable[int], core: int) -> int:
    """Set every thread of ``pids`` to run on ``core`` only; how many threads were set."""
    pinned = 0
    for pid in pids:
        tids: list[str] = []
        with contextlib.suppress(OSError):
            tids = os.listdir(f"/proc/{pid}/task")
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), {core})
                pinned += 1
    return pinned


def affinities(pids: Iterable[int]) -> dict[int, set[int]]:
    """Thread id -> the cores it may run on, for every thread of ``pids``."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    out[int(tid)] = os.sched_getaffinity(int(tid))
    return out


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
