"""Identity by behaviour: the decode's own K/V of the last prompt token checks every load.

A decode that loaded a prompt's KV computes the prompt's last token itself
(vLLM leaves it uncomputed so that it has logits to sample from), and that
forward writes the decode's own K/V into the slot the prefill's push
already filled. Fingerprints and block hashes name what someone thought of
(a path, a name); this compares what the two engines actually computed, so
weights or an adapter rewritten in place, or a rope table chosen by
``max_model_len``, show here even when every listed field agrees.

The worker keeps a copy of the block holding that slot in every layer of
every group with token KV (a state group has no token to compare) once the
load landed and before vLLM sees it, and compares the same blocks after the
forward that computed the token. Only that token's bytes can change (the
positions before it are loaded and not rewritten; the ones after it hold
nothing yet), so the elements that changed are the token's. Healthy
pairs differ by kernel rounding only (the prefill computed the token in a
batch of many, the decode alone); other weights, adapters or rope tables
differ by the size of the values themselves. ``TOLERANCE`` is the
relative difference allowed per KV dtype, set from bench/kv_check_spread.py's
measured spread (bench/RESULTS.md).

Owned by vLLM's worker thread. No I/O but its log lines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, NamedTuple, TypeVar

import torch

from daemon.client.vllm.specs import ReceiveSpec

log = logging.getLogger(f"vllm.{__name__}")

# The largest relative difference (|decode - prefill| / the changed elements'
# largest magnitude) a healthy pair may show, per KV cache dtype; a dtype not
# named uses DEFAULT_TOLERANCE. Measured on vLLM's CPU build
# (bench/RESULTS.md): healthy pairs differ by exactly 0 in float32 and
# bfloat16 (the same kernels on both sides), other weights by 1.16 or more,
# another rope table by 1.98. The margins leave room for a prefill and a
# decode whose kernels differ (GPU prefill and decode attention; not measured
# here); fp8 KV rounds to 3 mantissa bits, one step being 1/8 of a value.
TOLERANCE: Final[dict[str, float]] = {
    "float32": 1e-3,
    "bfloat16": 3e-2,
    "float16": 1e-2,
    "fp8": 0.3,
    "fp8_e4m3": 0.3,
    "fp8_e5m2": 0.5,
}
DEFAULT_TOLERANCE: Final = 3e-2
_V = TypeVar("_V")

# Magnitudes below this are rounding noise, not a scale to divide by.
_FLOOR: Final = 1e-6


class Slot(NamedTuple):
    """The block holding the checked token in one KV cache group."""

    group: int
    block: int


Layers = tuple[tuple[int, str, torch.Tensor], ...]  # a group's (index, name, block-major view)


class Kept(NamedTuple):
    """One group's checked block, copied from every layer of the group: ``[layers, ...block]``.

    ``layers`` are the group's views (vLLM's cache itself), read again after the forward.
    """

    layers: Layers
    block: int
    bytes: torch.Tensor


def _nbytes(kept: tuple[Kept, ...]) -> int:
    return sum(group.bytes.nbytes for group in kept)


class Disagreement(NamedTuple):
    """The largest difference of a checked token, where it exceeds the tolerance."""

    layer: int  # the layer's index in the worker's model order
    layer_name: str
    position: int
    difference: float  # relative: |decode - prefill| / the token's largest magnitude
    tolerance: float


def tolerance_for(kv_cache_dtype: str, model_dtype: str) -> float:
    """The tolerance for an instance's KV: its cache dtype, or the model's where "auto"."""
    name = model_dtype if kv_cache_dtype in ("", "auto") else kv_cache_dtype
    return TOLERANCE.get(name.removeprefix("torch."), DEFAULT_TOLERANCE)


def take(slots: tuple[Slot, ...], group_layers: tuple[Layers, ...]) -> tuple[Kept, ...]:
    """Copy the blocks of ``slots`` from every layer of their groups (block-major layer views)."""
    kept = []
    for group, block in slots:
        if group >= len(group_layers) or not group_layers[group]:
            continue
        views = group_layers[group]
        if not all(0 <= block < view.shape[0] for _, _, view in views):
            continue
        stacked = torch.stack([view[block] for _, _, view in views])
        kept.append(Kept(views, block, stacked))
    return tuple(kept)


def compare(
    kept: tuple[Kept, ...],
    position: int,
    tolerance: float,
    as_values: torch.dtype | None = None,
) -> tuple[Disagreement | None, float]:
    """The first layer whose token differs beyond ``tolerance``, and the largest difference seen.

    ``as_values``: the dtype the cache's bytes hold where its tensors are
    raw bytes (fp8 KV is stored as uint8).
    """
    worst = 0.0
    for group in kept:
        after = torch.stack([view[group.block] for _, _, view in group.layers])
        differences = relative_differences(group.bytes, after, as_values)
        worst = max(worst, float(differences.max()))
        beyond = (~(differences <= tolerance)).nonzero()  # NaN is a disagreement too
        if len(beyond):
            at = int(beyond[0])
            index, name, _ = group.layers[at]
            difference = float(differences[at])
            return Disagreement(index, name, position, difference, tolerance), worst
    return None, worst


def relative_differences(
    before: torch.Tensor, after: torch.Tensor, as_values: torch.dtype | None = None
) -> torch.Tensor:
    """Per layer (dim 0): max |after - before| over the changed elements, over their magnitude.

    Elements whose bits did not change count as equal (garbage past the
    prompt, even a NaN pattern, is the same on both sides of the forward),
    and only the changed elements (the recomputed token's) give the scale:
    stale values elsewhere in the block cannot hide a difference. A changed
    element that is not finite is an infinite difference.
    """
    if as_values is not None:
        before, after = before.view(as_values), after.view(as_values)
    layers = before.shape[0]
    bits = _BITS[before.element_size()]
    changed = (before.view(bits) != after.view(bits)).view(layers, -1)
    rows, columns = changed.nonzero(as_tuple=True)
    if not len(rows):
        return torch.zeros(layers)
    # Only the changed elements (a token's, a few thousand) are read as values.
    old = before.reshape(layers, -1)[rows, columns].float()
    new = after.reshape(layers, -1)[rows, columns].float()
    inf = float("inf")
    difference = (new - old).abs_().nan_to_num_(inf, inf, inf)
    difference[~torch.isfinite(new)] = inf
    magnitude = torch.maximum(
        old.abs().nan_to_num_(0.0, 0.0, 0.0), new.abs().nan_to_num_(0.0, 0.0, 0.0)
    )
    worst = torch.zeros(layers).scatter_reduce_(0, rows, difference, "amax")
    scale = torch.zeros(layers).scatter_reduce_(0, rows, magnitude, "amax").clamp_min_(_FLOOR)
    return worst / scale


# An integer dtype of each element size: equal bits, compared element by element.
_BITS: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class KvCheckSettings:
    """How a worker checks its loads: the tolerance, the dtype of fp8 bytes, and vLLM's limits.

    ``one_group``: the model has one KV cache group, so vLLM takes a load
    error for a running request as block ids (it refuses them with more).
    """

    tolerance: float
    as_values: torch.dtype | None = None
    one_group: bool = True


@dataclass(frozen=True)
class Plan:
    """What a checked load keeps until its check: where, and whose KV it was."""

    position: int
    slots: tuple[Slot, ...]
    # The blocks it loaded (group 0): vLLM recomputes from the first of them
    # in the request's order, whatever order they were named in.
    loaded: tuple[int, ...]
    shares: tuple[str, ...]  # the daemon requests it was loaded under
    peer: str  # the prefill's daemon (its node)


@dataclass(frozen=True)
class Finding:
    """A checked load whose KV is not this engine's."""

    request_id: str
    disagreement: Disagreement
    plan: Plan


class LoadChecks:
    """The worker's checks of its loads: planned at registration, kept on landing, compared after.

    ``layers``: per KV cache group, (index, name, block-major view) of each
    layer of vLLM's own cache (not a staging mirror: the check reads what
    the forward read and wrote).
    """

    def __init__(
        self,
        layers: tuple[Layers, ...],
        tolerance: float,
        as_values: torch.dtype | None = None,
        *,
        one_group: bool = True,
        bound: int = 4096,
        max_bytes: int = 512 << 20,
    ) -> None:
        self._layers = layers
        self._tolerance = tolerance
        self._as_values = as_values
        self._one_group = one_group
        self._bound = bound
        self._plans: dict[str, Plan] = {}
        self._kept: dict[str, tuple[tuple[Kept, ...], Plan]] = {}
        self._kept_bytes = 0
        self._max_bytes = max_bytes
        # Blocks of loads found not this engine's, for vLLM to recompute.
        self._invalid: set[int] = set()

    @classmethod
    def over(
        cls,
        views: dict[str, torch.Tensor],
        parts: dict[str, tuple[str, ...]],
        group_names: tuple[tuple[str, ...], ...],
        settings: KvCheckSettings,
    ) -> LoadChecks:
        """Checks over vLLM's block-major layer views (``parts``: each layer's, as K and V)."""
        layers = tuple(
            tuple(
                (index, part, views[part])
                for index, part in enumerate(p for name in names for p in parts.get(name, ()))
            )
            for names in group_names
        )
        return cls(layers, settings.tolerance, settings.as_values, one_group=settings.one_group)

    def plan(self, request_id: str, plan: Plan) -> None:
        self._plans[request_id] = plan
        _bounded(self._plans, self._bound)

    def plan_load(self, load: ReceiveSpec, shares: tuple[str, ...]) -> None:
        """A load the scheduler named a check for (``load.check``), under these ``shares``."""
        if load.check and load.block_ids and load.block_ids[0]:
            slots = tuple(Slot(*slot) for slot in load.check)
            loaded = tuple(load.block_ids[0])
            self.plan(load.request_id, Plan(load.position, slots, loaded, shares, load.peer))

    def landed(self, request_ids: set[str], failed: set[str]) -> None:
        """These loads are over: keep the checked blocks of those that landed (before a forward)."""
        for request_id in request_ids:
            plan = self._plans.pop(request_id, None)
            if plan is None or request_id in failed:
                continue
            kept = take(plan.slots, self._layers)
            self._kept[request_id] = (kept, plan)
            self._kept_bytes += _nbytes(kept)
            # Bounded in bytes too (a 70B rank keeps ~5 MiB a load): the
            # oldest, queued longest before its first forward, goes unchecked.
            while len(self._kept) > self._bound or self._kept_bytes > self._max_bytes:
                self._forget(next(iter(self._kept)))

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._plans.pop(request_id, None)
            self._forget(request_id)

    def _forget(self, request_id: str) -> tuple[tuple[Kept, ...], Plan] | None:
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            self._kept_bytes -= _nbytes(kept[0])
        return kept

    def after_forward(
        self, request_ids: list[str]
    ) -> tuple[list[Finding], list[tuple[str, float]]]:
        """Compare the loads whose last prompt token this step computed.

        Returns the findings, and each checked request's largest difference.
        """
        findings: list[Finding] = []
        differences: list[tuple[str, float]] = []
        for request_id in request_ids:
            kept = self._forget(request_id)
            if kept is None:
                continue
            groups, plan = kept
            disagreement, worst = compare(groups, plan.position, self._tolerance, self._as_values)
            differences.append((request_id, worst))
            if disagreement is not None:
                findings.append(Finding(request_id, disagreement, plan))
        return findings, differences

    def after_step(
        self, check: list[str], uncheck: list[str], checked: Callable[[float, bool], None]
    ) -> list[Finding]:
        """The step's checks: findings logged, counted (``checked``) and kept as load errors.

        One KV cache group: the loaded blocks are load errors, vLLM then
        drops the step's output for the request and recomputes it from the
        first of them (or fails it). Several: vLLM takes no load error for a
        running request, and the line says so.
        """
        self.drop(uncheck)
        if not check:
            return []
        findings, differences = self.after_forward(check)
        for request_id, difference in differences:
            # bench/kv_check_spread.py reads these lines for the healthy spread.
            log.debug("kvpushd: %s: kv check: difference %.6g", request_id, difference)
            checked(difference, difference <= self._tolerance)
        for found in findings:
            why = found.disagreement
            log.error(
                "kvpushd: %s: kv_mismatch: the KV pushed by prefill %s is not this engine's: "
                "layer %d (%s), position %d differs by %.3g (tolerance %.3g): %s",
                found.request_id,
                found.plan.peer,
                why.layer,
                why.layer_name,
                why.position,
                why.difference,
                why.tolerance,
                "not served, vLLM recomputes or fails it"
                if self._one_group
                else "vLLM takes no load error for a running request of a model with several "
                "KV cache groups: its first token was computed from this KV",
            )
            if self._one_group:
                self._invalid.update(found.plan.loaded)
        return findings

    def load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid


def _bounded(memory: dict[str, _V], bound: int) -> None:
    while len(memory) > bound:
        del memory[next(iter(memory))]


def values_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The dtype an fp8 KV cache's bytes hold (vLLM stores it as uint8); None otherwise."""
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    return None
