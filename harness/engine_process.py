"""Process mode of the simulated engine: one engine per process, driven over JSON lines.

``python -m harness.engine_process --engine-id E --role receiver --layout
LAYOUT --socket SOCK`` creates one :class:`daemon.sim.engine.SimEngine` on
the daemon's engine socket, then reads one command per line on stdin (or
``--commands FILE``) and writes replies, events and verification results as
JSON lines on stdout; the protocol is :class:`_Control`, the exit status
:func:`main`. The shm files are unlinked on ``close``, at the end of the
input, and on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, Final, TextIO

import msgspec

from daemon.client import ClientError, RpcError
from daemon.sim.engine import Expectation, SimEngine, VerifyReport
from daemon.sim.engine_layout import SimError, parse_layout, tail_pairs
from daemon.sim.engine_shm import SHM_DIR
from daemon.sim.kvpattern import Pairs
from schemas import rpc
from schemas.layout import Role

_EVENT_KINDS: Final[dict[str, type[rpc.Event]]] = {
    "kv_arrived": rpc.KvArrived,
    "blocks_freeable": rpc.BlocksFreeable,
    "request_failed": rpc.RequestFailed,
    "released": rpc.Released,
}


class _Control:
    """The JSON-lines control protocol of process mode.

    One command per input line, run in order: ``{"cmd": ..., "tag": ...,
    ...}``. Each gets one output line ``{"reply": cmd, "tag": ..., "ok": true,
    ...}`` or ``{"reply": cmd, "tag": ..., "ok": false, "error": ..., "code":
    ...}``. Events and verification results are written as they happen:
    ``{"event": "kv_arrived", "request_id": ..., "incarnation": ...}``,
    ``{"event": "verified", "request_id": ..., "ok": ..., "problems": [...]}``.

    Commands: ``prefill`` (request_id, blocks, incarnation, peer, kv_ready),
    ``kv_ready``, ``decode_register`` (request_id, blocks, peer, incarnation,
    and to verify on arrival ``source`` plus ``pairs`` or ``source_blocks``,
    the prefill side's logical blocks, tail-aligned with this engine's
    layout), ``verify`` (same fields), ``wait`` (request_id, event, timeout),
    ``release`` (wait), ``abort``, ``status``, ``info``, ``close``.
    """

    def __init__(self, engine: SimEngine, out: TextIO) -> None:
        self.engine = engine
        self.out = out
        self.failed_verifications = 0
        engine.on_event = self._event
        engine.on_report = self._report

    def emit(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message, default=_jsonable) + "\n")
        self.out.flush()

    def _event(self, event: rpc.Event) -> None:
        self.emit({"event": _event_name(event), **msgspec.to_builtins(event)})

    def _report(self, report: VerifyReport) -> None:
        self.failed_verifications += not report.ok
        self.emit(_report_json(report) | {"event": "verified"})

    async def run(self, command: dict[str, Any]) -> bool:
        """Run one command and write its reply; False once ``close`` was asked."""
        name = str(command.get("cmd", ""))
        reply: dict[str, Any] = {"reply": name, "tag": command.get("tag")}
        handler = getattr(self, f"cmd_{name}", None)
        try:
            if handler is None:
                raise SimError(f"unknown command {name!r}")
            reply |= {"ok": True, **(await handler(command) or {})}
        except RpcError as exc:
            reply |= {"ok": False, "error": exc.message, "code": exc.code}
        except (ClientError, SimError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            reply |= {"ok": False, "error": f"{type(exc).__name__}: {exc}", "code": None}
        self.emit(reply)
        return name != "close"

    def _pairs(self, c: dict[str, Any]) -> Pairs:
        if "pairs" in c:
            return tuple(tuple((int(d), int(s)) for d, s in group) for group in c["pairs"])
        layout = self.engine.layout
        return tail_pairs(layout, c["source_blocks"], layout, c["blocks"])

    async def cmd_prefill(self, c: dict[str, Any]) -> dict[str, Any]:
        reply = await self.engine.prefill(
            c["request_id"],
            c["blocks"],
            incarnation=c.get("incarnation", 1),
            peer=c.get("peer", ""),
            kv_ready=c.get("kv_ready", True),
        )
        return {"state": reply.state}

    async def cmd_kv_ready(self, c: dict[str, Any]) -> None:
        await self.engine.kv_ready(c["request_id"], c.get("incarnation", 1))

    async def cmd_decode_register(self, c: dict[str, Any]) -> dict[str, Any]:
        expect = Expectation(c["source"], self._pairs(c)) if "source" in c else None
        reply = await self.engine.decode_register(
            c["request_id"],
            c["blocks"],
            c.get("peer", ""),
            incarnation=c.get("incarnation", 1),
            expect=expect,
        )
        return {"state": reply.state}

    async def cmd_verify(self, c: dict[str, Any]) -> dict[str, Any]:
        report = self.engine.verify(
            c["request_id"],
            self._pairs(c),
            source_engine=c["source"],
            incarnation=c.get("incarnation", 1),
        )
        self.failed_verifications += not report.ok
        return _report_json(report)

    async def cmd_wait(self, c: dict[str, Any]) -> dict[str, Any]:
        kind = _EVENT_KINDS[c["event"]]
        incarnation = c.get("incarnation", 1)
        event = await self.engine.wait_event(
            c["request_id"], kind, incarnation=incarnation, timeout=c.get("timeout", 30.0)
        )
        result = {"event": msgspec.to_builtins(event)}
        report = self.engine.reports.get((c["request_id"], incarnation))
        if isinstance(event, rpc.KvArrived) and report is not None:
            result["verified"] = _report_json(report)
        return result

    async def cmd_release(self, c: dict[str, Any]) -> dict[str, Any]:
        reply = await self.engine.release(
            c["request_id"], c.get("incarnation", 1), wait=c.get("wait", True)
        )
        return {"result": _reply_kind(reply)}

    async def cmd_abort(self, c: dict[str, Any]) -> dict[str, Any]:
        reply = await self.engine.abort(c["request_id"], c.get("incarnation", 1))
        return {"result": _reply_kind(reply)}

    async def cmd_status(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"status": await self.engine.status()}

    async def cmd_info(self, c: dict[str, Any]) -> dict[str, Any]:
        return _info(self.engine)

    async def cmd_close(self, c: dict[str, Any]) -> None:
        return None


def _info(engine: SimEngine) -> dict[str, Any]:
    return {
        "engine_id": engine.engine_id,
        "role": engine.role.value,
        "pid": os.getpid(),
        "regions": [msgspec.to_builtins(r) for r in engine.region_specs],
        "groups": [msgspec.to_builtins(g) for g in engine.groups],
    }


def _report_json(report: VerifyReport) -> dict[str, Any]:
    return {
        "request_id": report.request_id,
        "incarnation": report.incarnation,
        "ok": report.ok,
        "blocks_checked": report.blocks_checked,
        "problems": report.problems(),
    }


def _reply_kind(reply: rpc.Reply) -> str:
    return "deferred" if isinstance(reply, rpc.Deferred) else "ok"


def _event_name(event: rpc.Event) -> str:
    return next(name for name, kind in _EVENT_KINDS.items() if isinstance(event, kind))


def _jsonable(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _start_line_reader(
    source: TextIO, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[str | None]
) -> None:
    """Feed lines from a blocking file into the loop (works for ttys, pipes, files)."""

    def pump() -> None:
        for line in source:
            loop.call_soon_threadsafe(queue.put_nowait, line)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=pump, name="sim-stdin", daemon=True).start()


async def _serve(args: argparse.Namespace, out: TextIO) -> int:
    # Signals are handled before any shm file exists, so a SIGTERM during
    # start-up still ends in close() and unlinks them.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    create = SimEngine.create(
        args.engine_id,
        args.role,
        parse_layout(_read_arg(args.layout)),
        args.socket,
        shm_prefix=args.shm_prefix,
        shm_dir=args.shm_dir,
        background=not args.no_background,
    )
    engine = await _unless_stopped(create, stop)
    if engine is _STOPPED:
        return 0
    control = _Control(engine, out)
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    source = open(args.commands) if args.commands else sys.stdin  # noqa: SIM115
    _start_line_reader(source, loop, lines)
    control.emit({"event": "ready", **_info(engine)})
    try:
        await _command_loop(control, lines, stop)
    finally:
        await engine.close()
        control.emit({"event": "closed", "failed_verifications": control.failed_verifications})
    return 1 if control.failed_verifications else 0


_STOPPED: Final = object()


async def _unless_stopped(coro: Any, stop: asyncio.Event) -> Any:
    """Await ``coro``, or cancel it and return ``_STOPPED`` if ``stop`` is set first.

    Cancelling is how a SIGTERM interrupts start-up or a long ``wait``:
    :meth:`SimEngine.create` cleans up its shm files when cancelled.
    """
    task = asyncio.ensure_future(coro)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return _STOPPED


async def _command_loop(
    control: _Control, lines: asyncio.Queue[str | None], stop: asyncio.Event
) -> None:
    """Run commands in order until ``close``, end of input, or a signal."""
    while True:
        line = await _unless_stopped(lines.get(), stop)
        if line is _STOPPED or line is None:
            return
        if not line.strip():
            continue
        try:
            command = json.loads(line)
        except json.JSONDecodeError as exc:
            control.emit({"reply": None, "ok": False, "error": f"bad JSON: {exc}"})
            continue
        if not isinstance(command, dict):
            control.emit({"reply": None, "ok": False, "error": "a command is a JSON object"})
            continue
        go_on = await _unless_stopped(control.run(command), stop)
        if go_on is _STOPPED or not go_on:
            return


def _read_arg(value: str) -> str:
    """``@path`` reads the file; anything else is the value itself."""
    if value.startswith("@"):
        with open(value[1:]) as f:
            return f.read()
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness.engine_process",
        description="Simulated inference engine for kvpushd (JSON-lines control on stdin/stdout).",
    )
    p.add_argument("--engine-id", required=True)
    p.add_argument("--role", required=True, choices=[r.value for r in Role])
    p.add_argument(
        "--layout",
        required=True,
        help='JSON list of groups, or @file: [{"num_blocks": 64, "block_bytes": 4096, '
        '"layers": 2, "kind": "attention", "per_logical": 1}]',
    )
    p.add_argument("--socket", required=True, help="the daemon's engine socket")
    p.add_argument("--shm-prefix", default=None, help="default: kvpushd-{engine_id}-{pid}")
    p.add_argument("--shm-dir", default=SHM_DIR)
    p.add_argument("--commands", default=None, help="read commands from this file, not stdin")
    p.add_argument("--no-background", action="store_true", help="start with zeroed blocks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one simulated engine until ``close``, end of input, SIGTERM or SIGINT.

    Exit status: 0, 1 when a verification failed, 2 when it could not start.
    """
    args = _parser().parse_args(argv)
    out = sys.stdout
    try:
        return _run_loop(_serve(args, out))
    except (ClientError, SimError, OSError, msgspec.MsgspecError) as exc:
        out.write(json.dumps({"event": "error", "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 2


def _run_loop(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
