"""Detecting a configuration that differs across ranks, before it can hang a collective.

Horovod matches collectives by name. If one rank sparsifies with density 0.01 and another with
0.02, or groups parameters differently, their collectives differ in size or name and the job
errors obscurely or stalls. So the optimizer wrappers compare a fingerprint of the configuration
on every rank once, at construction, and on a mismatch every rank raises the same error naming
the ranks and the settings that differ.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from typing import Any, Callable, Dict, List, Sequence

FINGERPRINT_BYTES = 16

#: A blocking allgather of one ``bytes`` payload per rank (any length, empty allowed) under a
#: collective name: every rank's payload, in rank order. Each framework provides one.
AllgatherBytes = Callable[[bytes, str], List[bytes]]


def json_bytes(obj: Any) -> bytes:
    """``obj`` as canonical JSON (sorted keys, unknown types as ``str``), UTF-8 encoded."""
    return json.dumps(obj, sort_keys=True, default=str).encode()


def fingerprint(config: Dict[str, Any]) -> bytes:
    """A fixed-size digest of a JSON-serialisable configuration (key order does not matter)."""
    return hashlib.sha256(json_bytes(config)).digest()[:FINGERPRINT_BYTES]


def _flatten(config: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(config, dict):
        flat: Dict[str, Any] = {}
        for key, value in config.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): config}


def mismatch_message(configs: Sequence[Dict[str, Any]]) -> str:
    """Explain how the configurations of the ranks differ from rank 0's.

    Args:
        configs: every rank's configuration, indexed by rank.

    Returns:
        A message naming each differing rank and setting, e.g.
        ``rank 1 differs from rank 0: options.density=0.02 (rank 0: 0.01)``.
    """
    reference = _flatten(configs[0])
    lines: List[str] = []
    for rank, config in enumerate(configs[1:], start=1):
        flat = _flatten(config)
        diffs = [f"{key}={flat.get(key, '<missing>')!r} (rank 0: {reference.get(key, '<missing>')!r})"
                 for key in sorted(set(reference) | set(flat)) if reference.get(key) != flat.get(key)]
        if diffs:
            shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
            lines.append(f"rank {rank} differs from rank 0: {shown}")
    return ("horovod_sparse configuration differs across ranks; every rank must build the "
            "optimizer with the same compression, options, grouping and model: " + " | ".join(lines))


def require_same_configuration(config: Dict[str, Any], allgather_bytes: AllgatherBytes) -> None:
    """Compare ``config`` across ranks; on a mismatch raise the same ``ValueError`` on every rank,
    naming the ranks and settings that differ (:func:`mismatch_message`).

    Collective: every rank must call it at the same point. It costs one allgather of a
    :data:`FINGERPRINT_BYTES` digest when the configurations agree, and one more of the
    configurations themselves (JSON) when they do not, so no rank ever waits on a collective the
    others skip.
    """
    digests = allgather_bytes(fingerprint(config), "hs.config.fingerprint")
    if all(digest == digests[0] for digest in digests):
        return
    configs = [json.loads(text) for text in allgather_bytes(json_bytes(config), "hs.config.describe")]
    raise ValueError(mismatch_message(configs))


def state_of_rank(root: int, mine: Any, allgather_bytes: AllgatherBytes) -> Any:
    """``root``'s ``mine`` on every rank (what the others pass is ignored: send None). For
    picklable state that every rank must hold alike, agreed once; collective."""
    return pickle.loads(allgather_bytes(pickle.dumps(mine), "hs.shared_state")[root])
