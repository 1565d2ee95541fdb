"""FirstFacts: settings every replica must share, compared once (their digest rides on a vote)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FirstFacts:
    """Settings every replica must share (fit: the optimizer's hyperparameters), compared in the
    first batch's vote: their digest joins the batch's, so the check costs no collective of its
    own; only when the vote disagrees are they gathered, to name the replica and the value."""

    what: str  # e.g. "the optimizer's settings"
    values: Mapping[str, str]  # e.g. {"param group 0 lr": "0.1"}
    advice: str  # what to do, e.g. "build the optimizer alike on every replica"

    def digest(self) -> int:
        text = "|".join(f"{k}={v}" for k, v in sorted(self.values.items()))
        return zlib.crc32(f"{self.what}:{text}".encode()) & 0x7FFFFFFF

    def mismatch(self, everyone: Sequence[Mapping[str, str]]) -> str | None:
        """The error naming the first setting that differs (replica and value), or None."""
        ref = everyone[0]
        diffs = []
        for r, theirs in enumerate(everyone[1:], start=1):
            for key in sorted(set(ref) | set(theirs)):
                a, b = ref.get(key, "<missing>"), theirs.get(key, "<missing>")
                if a != b:
                    diffs.append(f"{key} is {b} on replica {r} but {a} on replica 0")
        if not diffs:
            return None
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        return f"{self.what} differ across replicas: {'; '.join(diffs[:3])}{more}; {self.advice}"
