"""The fingerprint rule: a push pairs only engines whose KV is interchangeable.

Two engines' fingerprints (schemas/fingerprint.py) must be equal field for
field; the refusal names the first field that differs, with both values, so
the journal says which setting an operator must fix. An engine that
declares no fingerprint pairs only with another that declares none: a
fingerprinted engine never takes KV whose origin nobody vouched for.

Instances of different TP or PP sizes pair rank by rank: where both engines
name the KV heads their blocks hold (``kv_head_range``), those heads and the
layers they name (``layer_range``) must be the same, and ``tp_size`` and
``pp_size`` are not compared (a TP 2 prefill rank's one head fills a head
slice of a TP 1 decode rank's blocks; a prefill stage's layers fill those
layers of a decode stage's, statemachine/ranks.py); a pair mapped to the
wrong heads or layers is refused by what it names.
"""

from __future__ import annotations

from collections.abc import Collection

from schemas.fingerprint import Fingerprint
from schemas.reasons import Reason
from statemachine.errors import TrimRefused

# Where an engine sits among its instance's ranks, not what its KV is: not
# compared once both engines name the heads they hold.
PLACEMENT_FIELDS = frozenset({"tp_size", "pp_size"})
# A digest of the parameters one engine's rank holds: its TP shard of its
# stage's layers. Rank r of an instance holds the same shard as rank r of
# another only at equal TP and PP sizes (its ``kv_head_range`` and
# ``layer_range``, compared, then say it is rank r), so the digests are
# compared there, and only where both engines took one ("": a scheduler, or
# a worker that could not reach its model). Every rank pairs with its
# counterpart and a load is all or nothing, so at equal sizes the whole
# model is compared, shard by shard. Between other layouts no rank's shard
# is another's and nothing cheap up front compares them: the decode's own
# K/V of the prompt's last token (daemon/client/vllm/kvcheck.py) is the
# check there.
SHARD_FIELDS = frozenset({"weights"})


def first_difference(
    prefill: Fingerprint | None,
    decode: Fingerprint | None,
    *,
    ignore: Collection[str] = (),
) -> tuple[str, object, object] | None:
    """The first field whose values differ, with the prefill's and the decode's; None if equal.

    ``ignore``: fields not compared (a scheduler asks whether two instances'
    KV can pair at all, before it knows which ranks pair).
    """
    if prefill == decode:
        return None
    if prefill is None or decode is None:
        return ("fingerprint", _declared(prefill), _declared(decode))
    skip = frozenset(ignore)
    if prefill.names_heads and decode.names_heads:
        skip |= PLACEMENT_FIELDS
    if not _same_shards(prefill, decode):
        skip |= SHARD_FIELDS
    for name in Fingerprint.__struct_fields__:
        ours, theirs = getattr(prefill, name), getattr(decode, name)
        if ours != theirs and name not in skip:
            return (name, ours, theirs)
    return None


def _same_shards(prefill: Fingerprint, decode: Fingerprint) -> bool:
    """Whether the two engines' weights digests are of the same shard (SHARD_FIELDS)."""
    same_layout = (prefill.tp_size, prefill.pp_size) == (decode.tp_size, decode.pp_size)
    return same_layout and bool(prefill.weights) and bool(decode.weights)


def check_fingerprints(prefill: Fingerprint | None, decode: Fingerprint | None) -> None:
    """Raise TrimRefused(FINGERPRINT_MISMATCH) naming the differing field."""
    difference = first_difference(prefill, decode)
    if difference is not None:
        name, ours, theirs = difference
        raise TrimRefused(
            Reason.FINGERPRINT_MISMATCH,
            f"fingerprint field {name!r} differs: prefill engine {ours!r}, decode engine "
            f"{theirs!r}; nothing is written (the decode side must compute this prompt)",
        )


def _declared(fingerprint: Fingerprint | None) -> str:
    return "none declared" if fingerprint is None else "declared"
