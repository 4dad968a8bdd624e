"""The fingerprint rule: a push pairs only engines whose KV is interchangeable.

Two engines' fingerprints (schemas/fingerprint.py) must be equal field for
field; the refusal names the first field that differs, with both values, so
the journal says which setting an operator must fix. An engine that
declares no fingerprint pairs only with another that declares none: a
fingerprinted engine never takes KV whose origin nobody vouched for.
"""

from __future__ import annotations

from schemas.fingerprint import Fingerprint
from schemas.reasons import Reason
from statemachine.errors import TrimRefused


def first_difference(
    prefill: Fingerprint | None, decode: Fingerprint | None
) -> tuple[str, object, object] | None:
    """The first field whose values differ, with the prefill's and the decode's; None if equal."""
    if prefill == decode:
        return None
    if prefill is None or decode is None:
        return ("fingerprint", _declared(prefill), _declared(decode))
    for name in Fingerprint.__struct_fields__:
        ours, theirs = getattr(prefill, name), getattr(decode, name)
        if ours != theirs:
            return (name, ours, theirs)
    raise AssertionError("unequal fingerprints with equal fields")


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
