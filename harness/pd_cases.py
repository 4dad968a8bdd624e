"""The differential P/D fuzzer's cases: what one routed request does, drawn from a seed.

Pure: no vLLM, no daemon, no I/O. :func:`draw_run` turns a seed into a
sequence of batches, each batch a set of cases in flight at once and
perhaps one fault of the system; the same seed always gives the same
batches, so a failure is reproduced by its seed and case index alone.
:mod:`harness.pd_fuzz` runs them against real vLLM and judges them.

Each case draws, independently: the prompt's length (one below, at or one
above a block boundary, or anywhere up to the context), a decode-side
prefix hit, the prefill leg's sampling fields, how the router dispatches
the two legs, and one router fault. :func:`allowed` says which outcomes a
case permits: every completed answer must equal a single instance's
greedy tokens; remote KV is required only where nothing in the case or
its batch makes it impossible.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

# The prefill leg's max_tokens: the contract says 1; routers send more.
PREFILL_MAX_TOKENS: Final = (1, 2, 5)
# In flight at once: one alone, or a batch of up to this many.
MAX_IN_FLIGHT: Final = 24
VOCAB_LOW: Final = 2  # token ids below are special on the tiny models


class Dispatch(enum.Enum):
    # The prefill leg first; its kv_transfer_params go to the decode unchanged.
    PREFILL_FIRST = "prefill_first"
    # Both legs at once under a router-made transfer id (vLLM's push-mode proxy).
    CONCURRENT = "concurrent"


class RouterFault(enum.Enum):
    NONE = "none"
    DECODE_TWICE_AT_ONCE = "decode_twice_at_once"  # the same params to two decode legs
    DECODE_TWICE_AFTER = "decode_twice_after"  # again, after the first answered
    TRANSFER_ID_REUSED = "transfer_id_reused"  # two prefill legs under one transfer id
    PROMPT_DIFFERS = "prompt_differs"  # the decode leg's prompt is another one
    DECODE_DELAYED = "decode_delayed"  # the decode leg after the push's deadline
    ABORT_PREFILL_EARLY = "abort_prefill_early"  # the prefill's client goes before a byte
    ABORT_PREFILL_MID = "abort_prefill_mid"  # ... after the first streamed chunk
    ABORT_DECODE_EARLY = "abort_decode_early"
    ABORT_DECODE_MID = "abort_decode_mid"
    # One field of the decode leg's params dropped or retyped (a router's bug).
    ANSWER_TAMPERED = "answer_tampered"


class SystemFault(enum.Enum):
    NONE = "none"
    KILL_PREFILL_DAEMON = "kill_prefill_daemon"  # SIGKILL, then started again
    KILL_DECODE_DAEMON = "kill_decode_daemon"
    STOP_PREFILL_DAEMON = "stop_prefill_daemon"  # SIGSTOP for a while, then SIGCONT
    STOP_DECODE_DAEMON = "stop_decode_daemon"


class Outcome(enum.Enum):
    REMOTE = "remote"  # the right tokens, the prompt's KV loaded from the prefill
    LOCAL = "local"  # the right tokens, computed on the decode
    HTTP_ERROR = "http_error"  # an error answer (never a wrong one)
    ABORTED = "aborted"  # the client went away on purpose
    WRONG = "wrong"  # tokens other than a single instance's: never allowed


@dataclass(frozen=True)
class Model:
    """What the generator must know of the served model and the pair."""

    block_size: int
    max_model_len: int
    vocab_size: int
    # A sliding-window layer's window (0: none). vLLM frees the blocks a
    # window has left behind while the prefill leg generates, so a prefill
    # leg of more than one token may no longer hold the window's first block
    # the decode needs: that push is refused (content_mismatch), never wrong.
    sliding_window: int = 0


@dataclass(frozen=True)
class Case:
    """One routed request and what the router does wrong with it."""

    index: int
    prompt_len: int
    prompt_seed: int
    prefix_blocks: int  # decode-side prefix hit, sent to the decode first
    prefill_max_tokens: int
    prefill_min_tokens: int
    prefill_stop: tuple[int, ...]  # stop token ids (the servers skip the tokenizer)
    prefill_logprobs: int | None
    prefill_n: int
    decode_max_tokens: int
    dispatch: Dispatch
    fault: RouterFault
    # Seconds: when an abort happens after its leg's first byte was asked
    # for, or how long a delayed decode leg waits past the deadline.
    fault_s: float = 0.0
    # Where PROMPT_DIFFERS changes the decode leg's prompt (an index), and
    # which field ANSWER_TAMPERED drops or retypes (the same draw).
    differs_at: int = 0

    def prompt(self, vocab_size: int) -> list[int]:
        rng = random.Random(self.prompt_seed)
        return [rng.randrange(VOCAB_LOW, vocab_size) for _ in range(self.prompt_len)]

    def decode_prompt(self, vocab_size: int) -> list[int]:
        """The decode leg's prompt: the prompt, or with one token changed (PROMPT_DIFFERS)."""
        prompt = self.prompt(vocab_size)
        if self.fault is RouterFault.PROMPT_DIFFERS:
            at = self.differs_at % len(prompt)
            prompt[at] = VOCAB_LOW + (prompt[at] - VOCAB_LOW + 1) % (vocab_size - VOCAB_LOW)
        return prompt

    def prefill_fields(self) -> dict[str, object]:
        """The prefill leg's sampling fields beyond max_tokens (greedy throughout)."""
        fields: dict[str, object] = {}
        if self.prefill_min_tokens:
            fields["min_tokens"] = self.prefill_min_tokens
        if self.prefill_stop:
            fields["stop_token_ids"] = list(self.prefill_stop)
        if self.prefill_logprobs is not None:
            fields["logprobs"] = self.prefill_logprobs
        if self.prefill_n > 1:
            fields["n"] = self.prefill_n
        return fields

    def line(self) -> str:
        """The drawn fields, on one line."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        parts = []
        for name, value in fields.items():
            if isinstance(value, enum.Enum):
                value = value.value
            parts.append(f"{name}={value}")
        return " ".join(parts)


@dataclass(frozen=True)
class Batch:
    """Cases in flight at once, and at most one fault of the system during them."""

    index: int
    cases: tuple[Case, ...]
    system: SystemFault = SystemFault.NONE
    system_at_s: float = 0.0  # after the batch's start
    system_for_s: float = 0.0  # how long a stopped daemon stays stopped
    small_pool: bool = False  # the decode's KV pool is small (a shape's property)

    def line(self) -> str:
        return (
            f"batch={self.index} cases={[c.index for c in self.cases]} "
            f"system={self.system.value} at={self.system_at_s:.2f}s for={self.system_for_s:.2f}s"
        )


@dataclass(frozen=True)
class Mix:
    """How often each kind is drawn: the run's emphasis (weights, not probabilities)."""

    faulty_cases: float = 0.5  # the share of cases with a router fault
    system_faults: float = 0.2  # the share of batches with a system fault
    concurrent_batches: float = 0.5  # the share of batches of more than one case
    router_faults: tuple[RouterFault, ...] = tuple(
        f for f in RouterFault if f is not RouterFault.NONE
    )
    system: tuple[SystemFault, ...] = tuple(f for f in SystemFault if f is not SystemFault.NONE)


def prompt_len(rng: random.Random, model: Model, decode_max_tokens: int) -> int:
    """k*block - 1, k*block, k*block + 1 (a quarter each), or uniform up to the context."""
    room = model.max_model_len - decode_max_tokens - max(PREFILL_MAX_TOKENS) - 1
    kinds = rng.randrange(4)
    if kinds == 3:
        return rng.randint(1, room)
    k = rng.randint(1, max(1, (room - 1) // model.block_size))
    return max(1, min(room, k * model.block_size + (kinds - 1)))


def draw_case(rng: random.Random, index: int, model: Model, mix: Mix) -> Case:
    decode_max_tokens = rng.randint(2, 12)
    length = prompt_len(rng, model, decode_max_tokens)
    # vLLM hits at most the blocks before the prompt's last token.
    hit_room = (length - 1) // model.block_size
    prefix = rng.randint(0, hit_room) if hit_room and rng.random() < 0.3 else 0
    max_tokens = rng.choice(PREFILL_MAX_TOKENS)
    faulty = rng.random() < mix.faulty_cases
    fault = rng.choice(mix.router_faults) if faulty and mix.router_faults else RouterFault.NONE
    fault_s = 0.0
    if fault in (RouterFault.ABORT_PREFILL_EARLY, RouterFault.ABORT_DECODE_EARLY):
        fault_s = rng.uniform(0.0, 0.3)
    elif fault is RouterFault.DECODE_DELAYED:
        fault_s = rng.uniform(0.5, 2.0)
    return Case(
        index=index,
        prompt_len=length,
        prompt_seed=rng.randrange(1 << 30),
        prefix_blocks=prefix,
        prefill_max_tokens=max_tokens,
        prefill_min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.2 else 0,
        prefill_stop=(rng.randrange(VOCAB_LOW, model.vocab_size),) if rng.random() < 0.2 else (),
        prefill_logprobs=rng.randint(0, 2) if rng.random() < 0.2 else None,
        prefill_n=2 if rng.random() < 0.15 else 1,
        decode_max_tokens=decode_max_tokens,
        dispatch=rng.choice(list(Dispatch)),
        fault=fault,
        fault_s=fault_s,
        differs_at=rng.randrange(length),
    )


def draw_run(seed: int, cases: int, model: Model, mix: Mix | None = None) -> list[Batch]:
    """``cases`` cases from ``seed``, cut into batches: the same seed, the same run."""
    mix = mix or Mix()
    rng = random.Random(seed)
    batches: list[Batch] = []
    index = 0
    while index < cases:
        size = 1
        if rng.random() < mix.concurrent_batches:
            size = rng.randint(2, MAX_IN_FLIGHT)
        size = min(size, cases - index)
        drawn = tuple(draw_case(rng, index + i, model, mix) for i in range(size))
        index += size
        system = SystemFault.NONE
        if mix.system and rng.random() < mix.system_faults:
            system = rng.choice(mix.system)
        batches.append(
            Batch(
                index=len(batches),
                cases=drawn,
                system=system,
                system_at_s=rng.uniform(0.0, 1.0),
                system_for_s=rng.uniform(0.2, 3.0),
            )
        )
    return batches


# The decode leg's fields a connector must refuse to load from, once dropped
# or retyped: every kvpushd_* field of the prefill's answer, and what vLLM's
# push-mode proxy names the prefill by. (Dropped, the prefill's sizes mean
# 1, and do_remote_prefill means a request that loads nothing.)
NAMES_THE_PREFILL: Final = ("remote_engine_id", "remote_host", "remote_port", "transfer_id")
SIZES: Final = ("tp_size", "pp_size")


def tamper(params: dict[str, Any], at: int) -> tuple[dict[str, Any], str, bool]:
    """The decode leg's ``params`` with one field dropped or retyped (ANSWER_TAMPERED).

    Which field and how come from ``at``: the same case, the same tamper.
    Returns the params, the field, and whether the connector must refuse
    to load (the decode then computes its prompt).
    """
    keys = sorted(k for k in params if k != "do_remote_decode")
    key = keys[at % len(keys)]
    dropped = (at // len(keys)) % 2 == 0
    changed = dict(params)
    if dropped:
        del changed[key]
    else:
        changed[key] = [changed[key]]  # a list fits no field of the contract
    refused = (
        key.startswith("kvpushd_")
        or key in NAMES_THE_PREFILL
        or (key in SIZES and not dropped)
        or (key == "do_remote_prefill" and dropped)
    )
    return changed, key, refused


def find_case(batches: list[Batch], index: int) -> tuple[Batch, Case]:
    for batch in batches:
        for case in batch.cases:
            if case.index == index:
                return batch, case
    raise KeyError(f"no case {index} in this run (it has {sum(len(b.cases) for b in batches)})")


def is_clean(case: Case, batch: Batch) -> bool:
    """Nothing goes wrong around this case: no router fault, no fault of the system, one choice.

    Only a clean case must load remote KV, and only a clean case's request
    must end alike on both daemons (``journal replay`` names no disagreement).
    """
    return (
        case.fault is RouterFault.NONE and batch.system is SystemFault.NONE and case.prefill_n == 1
    )


def allowed(case: Case, batch: Batch, model: Model) -> frozenset[Outcome]:
    """The outcomes ``case`` permits for its decode leg(s); WRONG never is."""
    outcomes = {Outcome.REMOTE, Outcome.LOCAL}
    if case.fault in (RouterFault.ABORT_DECODE_EARLY, RouterFault.ABORT_DECODE_MID):
        outcomes.add(Outcome.ABORTED)
    prefill_gone = case.fault in (RouterFault.ABORT_PREFILL_EARLY, RouterFault.ABORT_PREFILL_MID)
    if prefill_gone and case.dispatch is Dispatch.PREFILL_FIRST:
        outcomes.add(Outcome.ABORTED)  # no answer to route: the router sends no decode leg
    # Remote KV is required where nothing makes it impossible: no fault of
    # the router or of the system, a pool with room, and tokens to load
    # (vLLM computes the prompt's last token itself, and a prefix hit's).
    loadable = case.prompt_len - 1 > case.prefix_blocks * model.block_size
    window_moved = model.sliding_window > 0 and (
        case.prefill_max_tokens > 1 or _window_freed(case.prompt_len, model)
    )
    if is_clean(case, batch) and not batch.small_pool and loadable and not window_moved:
        outcomes.discard(Outcome.LOCAL)
    return frozenset(outcomes)


def _window_freed(prompt_len: int, model: Model) -> bool:
    """The prefill freed the block the decode's recomputed last token still attends to.

    vLLM frees a finished request's out-of-window blocks before it hands its
    block table to the connector (``_connector_finished``: the tokens before
    ``prompt_len - window + 1`` are skipped, whole blocks of them freed). The
    decode recomputes the token at ``prompt_len - 1``, which attends back to
    ``prompt_len - window``: when ``prompt_len - window + 1`` starts a block,
    the block holding that token is gone (fuzz seed 20261207, case 39: a
    367-token prompt, window 48, a prefill leg of one token: 320 = 10 x 32).
    One prompt length in ``block_size`` on a sliding-window model.
    """
    first_kept = prompt_len - model.sliding_window + 1
    return first_kept > 0 and first_kept % model.block_size == 0


def shrink(case: Case, batch: Batch, model: Model) -> Iterator[tuple[Case, Batch]]:
    """Smaller variants of a failing case, smallest change first; each runs alone.

    Fewer requests (the case alone), no fault of the system, no router
    fault, plain sampling fields, no prefix hit, a shorter prompt (halved,
    and the block boundaries below it).
    """
    alone = dataclasses.replace(batch, cases=(case,))
    yield case, alone
    if batch.system is not SystemFault.NONE:
        quiet = dataclasses.replace(alone, system=SystemFault.NONE)
        yield case, quiet
        alone = quiet
    plain = dataclasses.replace(
        case, prefill_min_tokens=0, prefill_stop=(), prefill_logprobs=None, prefill_n=1
    )
    variants = [
        dataclasses.replace(case, fault=RouterFault.NONE, fault_s=0.0),
        plain,
        dataclasses.replace(case, prefix_blocks=0),
        dataclasses.replace(case, prefill_max_tokens=1),
        dataclasses.replace(case, dispatch=Dispatch.PREFILL_FIRST),
    ]
    for variant in variants:
        if variant != case:
            yield variant, dataclasses.replace(alone, cases=(variant,))
    for length in _shorter(case.prompt_len, model.block_size):
        hit = min(case.prefix_blocks, (length - 1) // model.block_size)
        shorter = dataclasses.replace(case, prompt_len=length, prefix_blocks=hit)
        yield shorter, dataclasses.replace(alone, cases=(shorter,))


def _shorter(length: int, block: int) -> list[int]:
    """Shorter prompt lengths worth trying: halves, and the boundaries around each block count."""
    out: list[int] = []
    n = length // 2
    while n >= 1:
        out.append(n)
        n //= 2
    k = (length - 1) // block
    while k >= 1:
        out += [k * block - 1, k * block, k * block + 1]
        k //= 2
    return sorted({n for n in out if 1 <= n < length}, reverse=True)
