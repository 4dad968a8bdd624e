"""Which daemon requests one rank's part of a transfer is, and on which engine each lies.

A push or a load of a TP/PP instance is one daemon request per pair of
ranks that exchange KV (a *share*, named by ``statemachine/ranks.py``).
Where a prefill rank's KV fills only part of a decode rank's blocks (more
prefill ranks or stages than the decode's), the share lies on a *slice*:
an engine registered over the same memory that holds only those heads and
layers. ``RankPlan`` computes both from this rank's place and its memory's
layout; the slices it names are kept in ``slices`` (vLLM's thread's), and
each spec on a slice carries its ``SliceEngine`` to the link's loop thread,
which registers it with the daemon.
Pure: no vLLM, no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from daemon.client.vllm.layout import slice_fingerprint
from daemon.client.vllm.specs import PushSpec, ReceiveSpec, SliceEngine, Source
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, LayerSpec
from statemachine.ranks import (
    HeadTarget,
    UnmappableRanks,
    forgone_sources,
    head_sources,
    head_targets,
    share_id,
    stage_layers,
    stage_sources,
    stage_targets,
)

# A slice engine's id -> its groups (over the engine's own memory) and fingerprint.
Slices = dict[str, SliceEngine]


def holds_run(layer_ids: list[int], first: int, end: int) -> bool:
    """Whether the layers [first, end) are one run of ``layer_ids`` (in that order)."""
    if first not in layer_ids:
        return False
    start = layer_ids.index(first)
    return layer_ids[start : start + end - first] == list(range(first, end))


class RankPlan:
    """One worker rank's shares of transfers and the engines they lie on.

    ``instance``: the whole instance's fingerprint; ``own``: this rank's
    (its heads and layers). What the memory says (``registered``) comes
    once vLLM registered its KV caches. ``corrupts``: the failpoints'
    negative controls (daemon/failpoints.py ``corrupts``), handed in so this
    stays pure.
    """

    def __init__(
        self,
        engine_id: str,
        instance: Fingerprint,
        own: Fingerprint,
        rank: int = 0,
        tp_size: int = 1,
        stage: int = 0,
        pp_size: int = 1,
        *,
        corrupts: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self.engine_id = engine_id
        self._corrupts = corrupts
        self.instance = instance
        self.own = own
        self.rank = rank
        self.tp_size = tp_size
        self.stage = stage
        self.pp_size = pp_size
        # Whether vLLM's tensors are head-major ([blocks, heads, ...]): only
        # then is a range of heads one contiguous run of every block.
        self.head_major = False
        # The model layer index of each layer of the registered group, in order
        # (None: vLLM's layer names carry none, and no layer slice is possible).
        self.layer_ids: list[int] | None = None
        self.groups: tuple[GroupSpec, ...] = ()
        # Head and layer slices of this rank's blocks, one engine each.
        # Registered when first needed and again on every new connection.
        self.slices: Slices = {}

    def registered(
        self, groups: tuple[GroupSpec, ...], layer_ids: list[int] | None, head_major: bool
    ) -> None:
        """What vLLM's registered memory says: its groups, layers and head order."""
        self.groups = groups
        self.layer_ids = layer_ids
        self.head_major = head_major

    # pushes ---------------------------------------------------------------

    def shares(self, push: PushSpec) -> list[PushSpec]:
        """This rank's shares of a push, each on the engine (or slice) it is read from.

        One per (decode stage, decode rank) it feeds when it split its push
        for more of them; else its own one share.
        """
        split = push.split_tp or self.tp_size
        targets: tuple[HeadTarget, ...] = (HeadTarget(self.rank, 0, 1),)
        if split > self.tp_size:
            targets = head_targets(self.rank, self.tp_size, split, self.instance.num_kv_heads)
        stages, layers = push.split_pp or self.pp_size, self.instance.num_layers
        into: tuple[int, ...] = (self.stage,)
        if stages > self.pp_size:
            into = stage_targets(self.stage, self.pp_size, stages, layers)
        sliced = len(into) > 1 or any(target.slices > 1 for target in targets)
        # The negative control's planted mis-mapping: each decode rank's (and
        # stage's) share read from the next slice (the daemon must refuse it).
        swap = sliced and self._corrupts("connector.swap_split")
        shares = []
        for i, stage in enumerate(into):
            held = stage_layers(into[(i + swap) % len(into)], stages, layers)
            for target in targets:
                share = share_id(push.transfer_id, target.share_rank, split, stage, stages)
                index = (target.slice_index + swap) % target.slices
                engine_id = self._source_engine(held, index, target.slices)
                shares.append(
                    dataclasses.replace(
                        push,
                        transfer_id=share,
                        engine_id=engine_id,
                        slice=self.slices.get(engine_id),
                    )
                )
        return shares

    def _source_engine(self, layers: tuple[int, int], index: int, slices: int) -> str:
        """The engine a split share is read from: this rank's, or a slice of its blocks.

        "" where no slice is one run of each block (the cache is not
        head-major, or the layers are not one run of the group): the share
        is given up, and its decode rank's load fails at its deadline.
        """
        whole = layers == self.own.layer_range
        if slices == 1 and whole:
            return self.engine_id
        if slices > 1 and not self.head_major:
            return ""
        if not whole and not holds_run(self.layer_ids or [], *layers):
            return ""
        return self.slice(layers, index, slices)

    # loads ----------------------------------------------------------------

    def stages(self, receive: ReceiveSpec) -> tuple[int, ...]:
        """The prefill stages whose layers this rank's stage holds."""
        return stage_sources(
            self.stage, self.pp_size, receive.source_stages, self.instance.num_layers
        )

    def sources(self, receive: ReceiveSpec) -> list[Source]:
        """The prefill ranks this rank loads from (UnmappableRanks: none can feed it)."""
        heads = head_sources(
            self.rank,
            self.tp_size,
            receive.source_ranks,
            self.instance.num_kv_heads,
            receive.shares_tp,
        )
        if not self.head_major and any(source.slices > 1 for source in heads):
            raise UnmappableRanks(
                "vLLM's KV cache here is not head-major ([blocks, heads, ...]): a prefill "
                "rank's heads are not one run of each block"
            )
        stages = self.stages(receive)
        if stages != (self.stage,):
            # Each prefill stage's layers become a run of this rank's group.
            for stage in stages:
                first, end = stage_layers(stage, receive.source_stages, self.instance.num_layers)
                if not holds_run(self.layer_ids or [], first, end):
                    raise UnmappableRanks(
                        f"this rank's KV cache does not hold layers {first}-{end - 1} as one run"
                    )
        return [Source(stage, source) for stage in stages for source in heads]

    def receiver(self, receive: ReceiveSpec, source: Source, *, swap: bool = False) -> ReceiveSpec:
        """The receiver for a prefill rank's share, on the engine its heads and layers fill."""
        heads = source.heads
        share = share_id(
            receive.transfer_id,
            heads.share_rank,
            receive.shares_tp,
            source.stage,
            receive.source_stages,
        )
        layers = stage_layers(source.stage, receive.source_stages, self.instance.num_layers)
        engine_id = self.engine_id
        if heads.slices > 1 or layers != self.own.layer_range:
            index = (heads.slice_index + swap) % heads.slices
            engine_id = self.slice(layers, index, heads.slices)
        return dataclasses.replace(
            receive, transfer_id=share, engine_id=engine_id, slice=self.slices.get(engine_id)
        )

    def unread(self, receive: ReceiveSpec) -> list[ReceiveSpec]:
        """Empty receivers for the prefill replicas nobody reads (TP above the KV heads)."""
        prefill_tp, heads = receive.source_ranks, self.instance.num_kv_heads
        unread = forgone_sources(self.rank, self.tp_size, prefill_tp, heads)
        if not unread:
            return []
        # No block, so no block hash: a receiver naming the load's hashes
        # with no block was refused by its own daemon (block_count_mismatch),
        # and the replica's push held the prefill's blocks to its deadline.
        forgone = dataclasses.replace(receive, block_ids=(), content="")
        return [
            self.receiver(forgone, Source(stage, source))
            for stage in self.stages(receive)
            for source in unread
        ]

    def forgone(self, forgone: ReceiveSpec) -> list[ReceiveSpec]:
        """The empty receivers that end the prefill's pushes of a transfer this instance drops.

        Paired instances: each rank ends its own sources' pushes, on the
        engines they would have written (and the unread replicas'). Otherwise
        the first rank of the first stage ends every prefill rank's push (its
        shares are named by the prefill's sizes), and the prefill daemon
        refuses each pairing.
        """
        if forgone.paired:
            try:
                sources = self.sources(forgone)
            except UnmappableRanks:
                pass
            else:
                own = [self.receiver(forgone, source) for source in sources]
                return own + self.unread(forgone)
        if self.rank != 0 or self.stage != 0:
            return []
        ranks = forgone.shares_tp
        return [
            dataclasses.replace(
                forgone,
                transfer_id=share_id(
                    forgone.transfer_id, rank, ranks, stage, forgone.source_stages
                ),
                block_ids=(),
            )
            for stage in range(forgone.source_stages)
            for rank in range(ranks)
        ]

    # slices ---------------------------------------------------------------

    def slice(self, layers: tuple[int, int], index: int, slices: int) -> str:
        """The engine of head slice ``index`` of ``slices`` of ``layers`` (noted on first use)."""
        first, end = self.own.kv_head_range
        width = (end - first) // slices
        heads = (first + index * width, first + (index + 1) * width)
        slice_id = self.engine_id
        if layers != self.own.layer_range:
            slice_id += f"-L{layers[0]}-{layers[1]}"
        if slices > 1:
            slice_id += f"-kvh{heads[0]}-{heads[1]}"
        if slice_id not in self.slices:
            sliced = tuple(self._slice_group(group, layers, index, slices) for group in self.groups)
            self.slices[slice_id] = SliceEngine(
                sliced, slice_fingerprint(self.instance, heads, layers)
            )
        return slice_id

    def _slice_group(
        self, group: GroupSpec, layers: tuple[int, int], index: int, slices: int
    ) -> GroupSpec:
        """Head slice ``index`` of ``slices`` of one group's blocks, of ``layers`` only."""
        nbytes = group.block_bytes // slices
        held = group.layers
        if layers != self.own.layer_range:
            assert self.layer_ids is not None  # sources() checked the run (one group)
            start = self.layer_ids.index(layers[0])
            held = held[start : start + layers[1] - layers[0]]
        return GroupSpec(
            group.kind,
            group.num_blocks,
            nbytes,
            tuple(LayerSpec(layer.region, layer.offset + index * nbytes) for layer in held),
            group.per_logical,
            block_stride=group.stride,
        )
