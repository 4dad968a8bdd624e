"""What a vLLM instance's configuration means to KvpushdConnector.

Answered from vLLM's config objects alone (read by attribute: this module
never imports vLLM, so it is tested without it):

- :func:`check_supported`: can the connector pair this instance's KV at all?
  It refuses at start-up, with one error naming the setting, a parallel
  layout it cannot map, instead of failing every request later (a TP 2 pair
  failed all of its requests with an opaque 500 before this check).
- :func:`prompt_digest`: which prompt a transfer's KV was computed for, so
  that a router that changed the prompt between the legs gets a local
  prefill, never another prompt's KV.
- :func:`group_windows`, :func:`window_gap`: a hybrid model's groups'
  windows (client.vllm.hashes.prompt_blocks moves a sliding-window group's blocks
  inside its window only), and which prompts a decode cannot load (a window
  the prefill no longer holds whole).
- :func:`mla_rope_warning`: an MLA model on vLLM's CPU build with its
  stock rotary op, which vLLM itself computes wrong (a line at start-up).
- :func:`fingerprint`: what produced this instance's KV. The worker
  registers its engine with it, the prefill scheduler sends it in
  ``kv_transfer_params``, and the decode scheduler loads remote KV only when
  the prefill's equals its own (a prefill serving other weights made the
  decode side serve wrong tokens before this check).
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from daemon.client.vllm.rope import rope_identity
from schemas.fingerprint import CONNECTOR_PROTOCOL, MAX_RANKS, Fingerprint
from statemachine.ranks import (
    UnmappableRanks,
    head_sources,
    heads_of,
    split_source,
    stage_layers,
    stage_sources,
    stage_targets,
)

# Parallel settings the connector serves only at 1, with the flag that sets
# each. Tensor and pipeline parallelism are served (each rank pushes its own
# KV heads of its stage's layers to the decode rank holding them: rank to
# rank with equal sizes, into head or layer slices when the prefill has a
# multiple of the decode's ranks or stages), and so is data parallelism (a
# DP engine is an instance of its own to the daemon: a request's KV moves
# from the prefill engine that computed it to the decode engine serving it,
# whichever the router and vLLM's balancer picked); context-parallel ranks
# split a block's tokens, which no pairing here maps.
SINGLE_RANK_SETTINGS: Final = (
    ("decode_context_parallel_size", "--decode-context-parallel-size"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
)

# The KV cache groups moved when a model has more than one (vLLM's spec
# classes, by name: this module never imports vLLM).
FULL_ATTENTION: Final = "FullAttentionSpec"
SLIDING_WINDOW: Final = "SlidingWindowSpec"
MAMBA: Final = "MambaSpec"
HYBRID_KINDS: Final = frozenset({FULL_ATTENTION, SLIDING_WINDOW, MAMBA})
# vLLM's Mamba cache mode the connector moves state in: one state block per
# request that holds the state after every computed token (prefix caching
# off). "align" and "all" keep checkpoints at block boundaries, which no
# pairing here names.
MAMBA_CACHE_MODE: Final = "none"
# vLLM's custom op whose CPU kernel mis-rotates MLA (mla_rope_warning).
ROTARY_OP: Final = "rotary_embedding"
# Prompt tokens a decode computes itself on a model with recurrent state: the
# last. The prefill computes the prompt without it and hands over the state
# after the rest; the decode applies the last token once (applied on both
# sides, the state would take it twice: docs/mamba-on-vllm-cpu.md).
STATE_BACKOFF: Final = 1
# The block id vLLM's block pool keeps for "no block" (its null block, id 0,
# never handed to a request): a sliding-window group's out-of-window blocks.
NULL_BLOCK: Final = 0

Blocks = tuple[tuple[int, ...], ...]  # block ids per KV cache group, in group order


class UnsupportedLayout(ValueError):
    """This vLLM instance's KV cannot be paired by KvpushdConnector; the message says why."""


def check_supported(vllm_config: Any, kv_cache_config: Any = None) -> None:
    """Raise :class:`UnsupportedLayout` for a layout the connector cannot pair.

    Called when vLLM builds the connector (scheduler and every worker), so
    vLLM refuses to start rather than serve requests that cannot load.
    """
    parallel = vllm_config.parallel_config
    for setting, flag in SINGLE_RANK_SETTINGS:
        value = getattr(parallel, setting, 1)
        if value != 1:
            raise UnsupportedLayout(
                f"KvpushdConnector: {setting} = {value} ({flag} {value}) is not supported: "
                f"this connector pairs tensor-, pipeline- and data-parallel ranks only "
                f"(context parallel sizes of 1); start this instance with {flag} 1, or use "
                f"another KV connector for it"
            )
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) > 1:
        _check_hybrid(groups, getattr(parallel, "pipeline_parallel_size", 1))
    if groups is not None and any(_is_state(group) for group in groups):
        _check_state(groups, getattr(parallel, "tensor_parallel_size", 1))


def _is_state(group: Any) -> bool:
    return type(getattr(group, "kv_cache_spec", None)).__name__ == MAMBA


def _check_hybrid(groups: Sequence[Any], pp_size: int) -> None:
    """Several KV cache groups (vLLM's hybrid allocator): moved when each is one we move."""
    start = f"KvpushdConnector: this model's KV cache has {len(groups)} KV cache groups"
    fallback = "start vLLM with --disable-hybrid-kv-cache-manager, or use another KV connector"
    for g, group in enumerate(groups):
        kind = type(group.kv_cache_spec).__name__
        if kind not in HYBRID_KINDS:
            raise UnsupportedLayout(
                f"{start}; group {g} is {kind}, and this connector moves full-attention, "
                f"sliding-window and Mamba groups only: {fallback}"
            )
        if not getattr(group, "enable_kv_transfer", True):
            raise UnsupportedLayout(f"{start}; group {g} is not transferable: {fallback}")
    # A Mamba group's "block" is one state whatever its token count: only
    # the attention groups' block sizes must agree (vLLM pads the state's
    # page to the attention page instead).
    attention = [group for group in groups if not _is_state(group)]
    if len({group.kv_cache_spec.block_size for group in attention}) > 1:
        raise UnsupportedLayout(f"{start} with different block sizes: {fallback}")
    if pp_size != 1:
        raise UnsupportedLayout(
            f"{start} and pipeline_parallel_size = {pp_size} (--pipeline-parallel-size): "
            f"several groups are moved with pipeline stages of 1 only; {fallback}"
        )


def _check_state(groups: Sequence[Any], tp_size: int) -> None:
    """Mamba/SSM state groups: moved in mode "none", whole, between TP 1 instances."""
    start = "KvpushdConnector: this model keeps Mamba/SSM state"
    for g, group in enumerate(groups):
        if not _is_state(group):
            continue
        spec = group.kv_cache_spec
        mode = getattr(spec, "mamba_cache_mode", MAMBA_CACHE_MODE)
        if mode != MAMBA_CACHE_MODE:
            raise UnsupportedLayout(
                f"{start} in mamba_cache_mode {mode!r} (group {g}): the connector moves the "
                f"one running state of mode 'none' only; start vLLM with "
                f"--no-enable-prefix-caching (--mamba-cache-mode none)"
            )
        # (Prefill checkpoint blocks are allocated in mode "align" only.)
        extra = getattr(spec, "num_speculative_blocks", 0)
        if extra:
            raise UnsupportedLayout(
                f"{start} with {extra} speculative state blocks per request "
                f"(group {g}): the connector moves one state block per request; start vLLM "
                f"without speculative decoding for this model, or use another KV connector"
            )
    if tp_size != 1:
        raise UnsupportedLayout(
            f"{start} and tensor_parallel_size = {tp_size}: the state is split by head "
            f"and by conv projection across ranks, which no pairing here maps; start this "
            f"instance with --tensor-parallel-size 1 (data parallel is served), or use "
            f"another KV connector"
        )


def mla_rope_warning(vllm_config: Any) -> str | None:
    """The start-up line for an MLA model that vLLM's CPU build computes wrong, or None.

    vLLM's CPU rotary op (``RotaryEmbedding.forward_cpu``, run while the
    ``rotary_embedding`` custom op is enabled) takes MLA's strided 3-D query
    and rope-key views for 2-D ones: a token's rotation depends on how the
    forward pass batches it, so a P/D decode (the last prompt token computed
    alone) differs from a single instance whatever the KV
    (docs/mla-on-vllm-cpu.md). vLLM's pure-torch rope is right.
    """
    model = getattr(vllm_config, "model_config", None)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    compilation = getattr(vllm_config, "compilation_config", None)
    if not getattr(model, "use_mla", False) or str(device) != "cpu":
        return None
    if not custom_op_enabled(getattr(compilation, "custom_ops", None) or (), ROTARY_OP):
        return None
    return (
        "KvpushdConnector: this MLA model runs vLLM's CPU rotary op, which mis-rotates MLA's "
        "query and rope key: its tokens depend on the batch, and P/D tokens differ from a "
        "single instance's whatever the KV; start every instance with vLLM's own rope "
        "(custom_ops: -rotary_embedding: --compilation-config "
        '\'{"custom_ops": ["all", "-rotary_embedding"]}\'; docs/mla-on-vllm-cpu.md)'
    )


def custom_op_enabled(custom_ops: Sequence[str], name: str) -> bool:
    """Whether vLLM runs its custom op ``name`` (vLLM's ``CustomOp.enabled``, by its rule).

    ``+name`` enables it, ``-name`` disables it, otherwise the base mode
    says: on under ``all``, off under ``none`` (vLLM adds one of the two
    when it resolves its config: ``none`` when Inductor compiles).
    """
    if f"-{name}" in custom_ops:
        return False
    return f"+{name}" in custom_ops or "none" not in custom_ops or "all" in custom_ops


def group_states(kv_cache_config: Any) -> tuple[bool, ...]:
    """Which KV cache groups hold recurrent state (Mamba/SSM), in group order.

    (False,) when vLLM names no groups: one full-attention group.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(_is_state(group) for group in groups) or (False,)


def prompt_backoff(states: Sequence[bool]) -> int:
    """The prompt tokens a decode computes itself (:data:`STATE_BACKOFF` with state, else 0)."""
    return STATE_BACKOFF if any(states) else 0


def group_windows(kv_cache_config: Any) -> tuple[int, ...]:
    """Each KV cache group's sliding window in tokens, in group order (0: full attention).

    (0,) when vLLM names no groups: one full-attention group.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(
        int(group.kv_cache_spec.sliding_window)
        if type(group.kv_cache_spec).__name__ == SLIDING_WINDOW
        else 0
        for group in groups
    ) or (0,)


def window_gap(prompt_len: int, block_size: int, windows: Sequence[int]) -> int | None:
    """The sliding window that lacks a token the decode needs for this prompt, or None.

    A decode that loaded the whole prompt computes its last token again (at
    ``prompt_len - 1``), which attends back to ``prompt_len - window``. The
    prefill, done with the prompt, kept only what its next token attends to,
    from ``prompt_len - window + 1`` on: when that starts a block, the block
    holding ``prompt_len - window`` is gone on both sides, and the decode
    would read vLLM's null block in its place.
    """
    for window in windows:
        first_kept = prompt_len - window + 1
        if window and first_kept > 0 and first_kept % block_size == 0:
            return window
    return None


def fingerprint(
    vllm_config: Any,
    engine_version: str,
    model_id: str = "",
    kv_cache_config: Any = None,
    attention_isa: str = "",
) -> Fingerprint:
    """The fingerprint of the KV this vLLM instance computes.

    The same on the scheduler and on every worker (all of it comes from the
    config). ``model_id`` replaces vLLM's ``--model`` value as the model's
    identity: for the same weights at different paths on different hosts.
    A model with several KV cache groups names each group's window in the
    layout (an instance with the hybrid allocator off holds one group, and
    the two do not pair). ``attention_isa``: the kernels a CPU instance's
    attention lays its blocks out for (they differ by host: "amx", "vec"...).
    """
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "") or ""
    layout = f"{device}:{getattr(backend, 'name', backend) or 'auto'}"
    if attention_isa:
        layout += f":isa={attention_isa}"
    if getattr(model, "use_mla", False):
        layout += ":mla"
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    names = [
        _state_name(group.kv_cache_spec) if _is_state(group) else f"swa{w}" if w else "full"
        for group, w in zip(groups, group_windows(kv_cache_config), strict=False)
    ]
    if names not in ([], ["full"]):
        layout += ":groups=" + ",".join(names)
    return Fingerprint(
        model=model_id or str(model.model),
        revision=str(model.revision or ""),
        dtype=str(model.dtype).removeprefix("torch."),
        kv_cache_dtype=str(cache.cache_dtype),
        block_size=int(cache.block_size),
        num_layers=int(model.get_total_num_hidden_layers()),
        num_kv_heads=kv_heads(model),
        head_size=int(model.get_head_size()),
        kv_layout=layout,
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        pp_size=int(getattr(parallel, "pipeline_parallel_size", 1)),
        engine=f"vllm {engine_version}",
        protocol=CONNECTOR_PROTOCOL,
        quantization=str(getattr(model, "quantization", None) or ""),
        overrides=_overrides_digest(getattr(model, "hf_overrides", None)),
        speculative=_speculative(getattr(vllm_config, "speculative_config", None)),
        rope=rope_identity(model),
    )


def _state_name(spec: Any) -> str:
    """A Mamba group's state as both sides must lay it out: its kind, shapes and dtypes.

    The shapes carry the conv state's layout (``[kernel-1, dim]`` or its
    transpose, VLLM_SSM_CONV_STATE_LAYOUT): two instances that differ in it
    hold the same state in other bytes.
    """
    kind = getattr(getattr(spec, "mamba_type", None), "name", None) or "mamba"
    shapes = ";".join("x".join(str(n) for n in shape) for shape in spec.shapes)
    dtypes = ";".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    return f"{kind.lower()}[{shapes}|{dtypes}]"


def kv_heads(model: Any) -> int:
    """The KV heads a block holds across all TP ranks, as the rank pairing splits them.

    MLA caches one latent per token (DeepSeek's kv_lora_rank + rope dims),
    the same on every TP rank: one head, replicated, whatever the model's
    config says of its attention heads (128 for DeepSeek-V3). Taken from the
    config, a TP 2 prefill's ranks claimed half the heads each of a block
    that holds the whole latent, and no TP 2 -> 1 pairing could form.
    """
    if getattr(model, "use_mla", False):
        return 1
    return int(model.get_total_num_kv_heads())


# Speculative methods that keep no KV of their own (they propose from the
# tokens): the target's KV is the same with them or without.
_KV_FREE_PROPOSERS: Final = frozenset({"ngram", "suffix"})


def _overrides_digest(overrides: Any) -> str:
    """A digest of vLLM's ``hf_overrides`` ("": none); a callable is named by its qualified name."""
    if not overrides:
        return ""
    if callable(overrides):
        text = f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
    else:
        text = repr(sorted(dict(overrides).items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _speculative(config: Any) -> str:
    """The speculative settings that change what is cached ("": none that do)."""
    method = getattr(config, "method", None) if config is not None else None
    if not method or method in _KV_FREE_PROPOSERS:
        return ""
    draft = getattr(config, "model", None) or ""
    tokens = getattr(config, "num_speculative_tokens", None) or 0
    return f"{method}:{draft}:{tokens}"


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A digest of a prompt's token ids (BLAKE2b-128 over them as int64, hex).

    Sent by the prefill with the prompt's length in ``kv_transfer_params``;
    the decode side loads the KV only for a prompt with the same digest.
    """
    return hashlib.blake2b(array.array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def rank_fingerprint(instance: Fingerprint, rank: int, stage: int = 0) -> Fingerprint:
    """The fingerprint (stage ``stage``, TP rank ``rank``)'s engine registers with.

    It names the KV heads and the layers the engine holds. The prefill daemon
    pairs two engines that name them only on the same heads and layers, so a
    rank mapped to another rank's heads or stage's layers is refused, never
    written (statemachine/fingerprint.py).
    """
    heads = heads_of(rank, instance.tp_size, instance.num_kv_heads)
    layers = stage_layers(stage, instance.pp_size, instance.num_layers)
    return msgspec.structs.replace(instance, kv_head_range=heads, layer_range=layers)


def slice_fingerprint(
    instance: Fingerprint, heads: tuple[int, int], layers: tuple[int, int]
) -> Fingerprint:
    """The fingerprint of a slice of a rank's blocks: KV heads ``heads`` of layers ``layers``."""
    return msgspec.structs.replace(instance, kv_head_range=heads, layer_range=layers)


def rank_map_problem(
    prefill: Fingerprint,
    decode: Fingerprint,
    split_tp: int | None = None,
    split_pp: int | None = None,
) -> str | None:
    """Why the prefill instance's ranks cannot feed the decode instance's, or None.

    Served: equal TP sizes, a prefill with a multiple of the decode's TP
    ranks (each decode rank's heads from several prefill ranks' whole
    blocks), or a decode with a multiple of the prefill's that the prefill
    split its push for (``split_tp``: each decode rank's heads from a slice
    of one prefill rank's blocks); and equal PP sizes or prefill stages
    nested in the decode's (each decode stage's layers from several prefill
    stages), or a decode with more stages that the prefill split its push
    for (``split_pp``: each decode stage then sees a prefill of its own PP).
    """
    try:
        for rank in range(decode.tp_size):
            head_sources(rank, decode.tp_size, prefill.tp_size, decode.num_kv_heads, split_tp)
        for stage in range(decode.pp_size):
            stage_sources(stage, decode.pp_size, split_pp or prefill.pp_size, decode.num_layers)
    except UnmappableRanks as exc:
        return str(exc)
    return None


def rank_count(value: object) -> int | None:
    """A TP or PP size read from kv_transfer_params, if it is one (1..MAX_RANKS)."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_RANKS:
        return value
    return None


def _told(value: object, own: int) -> int | None:
    """A size the router named, if it is one larger than ``own`` (None otherwise)."""
    told = rank_count(value)
    return told if told is not None and told > own else None


def split_tp(instance: Fingerprint, decode_tp: object) -> int:
    """The TP size this prefill instance names its shares by, told the decode's (or not).

    The decode's, when the router named it on the prefill leg, it is larger
    than this instance's, and this instance's ranks map onto its ranks head
    for head (each prefill rank then pushes one share per decode rank it
    feeds); this instance's own otherwise (a decode with more ranks refuses
    such a push, and computes the prompt).
    """
    own = instance.tp_size
    told = _told(decode_tp, own)
    if told is None:
        return own
    try:
        for rank in range(told):
            split_source(rank, told, own, instance.num_kv_heads)
    except UnmappableRanks:
        return own
    return told


def split_pp(instance: Fingerprint, decode_pp: object) -> int:
    """The PP size this prefill instance names its shares by, told the decode's (or not).

    As :func:`split_tp`, for stages: the decode's when it is larger and each
    of its stages' layers lies inside one of this instance's stages.
    """
    own = instance.pp_size
    told = _told(decode_pp, own)
    if told is None or told > instance.num_layers:
        return own
    try:
        for stage in range(own):
            stage_targets(stage, own, told, instance.num_layers)
    except UnmappableRanks:
        return own
    return told
