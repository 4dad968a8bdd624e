"""The scheduler side of the behavioural KV check: which loads are checked, and in which step.

A decode load is checked where the prefill computed the token the decode
recomputes (the prompt's last): every model without recurrent state (with
state, the prefill stops one token short and the decode applies the last
one to the state, so nothing pushed sits there). The scheduler names, per
token-KV group, the block holding that token when it allocates the load,
and names the request again in the step whose forward computes the token:
the worker side (daemon/client/vllm/kvcheck.py) keeps the pushed bytes when
the load lands and compares after that forward. Owned by vLLM's scheduler
thread; bounded. No torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from daemon.client.vllm.specs import ReceiveSpec, remember

Slots = tuple[tuple[int, int], ...]  # (group, block id) per token-KV group


def check_slots(
    prompt_len: int, block_size: int, group_blocks: Sequence[Sequence[int]], states: Sequence[bool]
) -> Slots:
    """Each token-KV group's block holding the prompt's last token (position ``prompt_len - 1``)."""
    if prompt_len <= 0:
        return ()
    index = (prompt_len - 1) // block_size
    return tuple(
        (group, int(ids[index]))
        for group, ids in enumerate(group_blocks)
        if not (group < len(states) and states[group]) and index < len(ids)
    )


class CheckPlan:
    """Loads to check -> the position of the prompt's last token, until their forward."""

    def __init__(self, block_size: int, states: Sequence[bool]) -> None:
        self._block_size = block_size
        self._states = states
        self._waiting: dict[str, int] = {}

    def plan(
        self, load: ReceiveSpec, prompt_len: int, group_blocks: Sequence[Sequence[int]]
    ) -> ReceiveSpec:
        """``load`` naming the blocks to check (unchanged where none: ``prompt_len`` 0)."""
        check = check_slots(prompt_len, self._block_size, group_blocks, self._states)
        if not check:
            return load
        remember(self._waiting, load.request_id, prompt_len - 1)
        return dataclasses.replace(load, check=check, position=prompt_len - 1)

    def scheduled(self, new_requests: Iterable[Any], check: list[str], uncheck: list[str]) -> None:
        """Of this step's new requests (vLLM's ``NewRequestData``): those checked now, and never.

        A loaded request first runs as a new one, from the prompt's last
        token; one that starts anywhere else (its load failed and it
        recomputes, or it was preempted) is never checked.
        """
        if not self._waiting:
            return
        for new in new_requests:
            position = self._waiting.pop(new.req_id, None)
            if position is not None:
                checked = new.num_computed_tokens == position
                (check if checked else uncheck).append(new.req_id)

    def forget(self, request_ids: Iterable[str]) -> list[str]:
        """Loads that will never be checked (failed, ended): those that were waiting."""
        return [r for r in request_ids if self._waiting.pop(r, None) is not None]
