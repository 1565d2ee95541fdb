"""The portable writer: a checkpoint as whole files, which the chief alone writes.

Every replica encodes its per-replica objects (with ``all_per_rank``, pipeline stages: all of
them) and sends them to the chief, which holds the directory, encodes the shared objects (one
copy: mirrored on every replica) and writes ``shared.*``, ``rank-<r>.*`` and ``metadata.json``
(files.write_checkpoint: atomic, hashed). Restoring reads the states each replica needs from any
such checkpoint (``states.portable_states``: any strategy, any number of replicas) and validates
them before anything is assigned.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from stratagem.train.checkpoint.files import _payload, write_checkpoint
from stratagem.train.checkpoint.lock import CheckpointDirectoryLockedError, writer_tag
from stratagem.train.checkpoint.states import (
    apply_states,
    encode_states,
    portable_states,
    validate_states,
)
from stratagem.train.checkpoint.ties import StageTies
from stratagem.train.checkpoint.writer import WriteSite


class PortableWriter:
    """``CheckpointWriter`` of whole files: per-replica states gathered to the chief, which writes."""

    def save(self, site: WriteSite, step: int) -> str:
        try:
            ties = StageTies.of(site.extended)  # weights tied across pipeline stages
            mine: tuple[bytes, bytes] | None = _payload(
                *encode_states(site.objects, shared=None if site.all_per_rank else False, ties=ties)
            )
            encode_error = ""
        except (TypeError, ValueError) as e:
            mine, encode_error = None, f"{type(e).__name__}: {e}"
        per_rank = site.comm.gather_object((mine, encode_error), 0)  # to the writer only
        result: tuple[str, str, str] = ("", "", "")
        if per_rank is not None:
            try:
                bad = [f"replica {r}: {err}" for r, (_, err) in enumerate(per_rank) if err]
                if bad:
                    raise TypeError(f"a state cannot be encoded ({'; '.join(bad)})")
                site.own_directory()
                shared = _payload(*({}, {}) if site.all_per_rank else encode_states(site.objects, shared=True))
                path = write_checkpoint(
                    site.directory, step, shared, [m for m, _ in per_rank],  # type: ignore[misc]
                    on_file_written=site.on_file_written, writer=writer_tag(),
                )  # fmt: skip
                site.prune()
                result = (str(path), "", "")
            except Exception as e:  # noqa: BLE001 - sent to every replica below
                result = ("", type(e).__name__, f"{e}")
        result = site.comm.broadcast_object(result, 0)
        if result[1] == "CheckpointDirectoryLockedError":
            raise CheckpointDirectoryLockedError(result[2])
        if result[1]:
            raise RuntimeError(
                f"the chief could not write the checkpoint at step {step} in {site.directory}: "
                f"{result[1]}: {result[2]} (earlier checkpoints are intact; nothing of this save was left)"
            )
        site.extended.checkpoint_saved(result[0])
        return result[0]

    def prepare(self, site: WriteSite, path: Path, meta: dict[str, Any]) -> Callable[[], None]:
        states = portable_states(path, meta, site.objects, site.comm.rank, site.comm.world_size)
        ties = StageTies.of(site.extended)
        if ties is not None:  # a tied weight, written once, restores every stage's end
            for name, obj in dict(site.objects).items():
                if isinstance(obj, nn.Module) and isinstance(states.get(name), dict):
                    states[name] = ties.restored(name, obj, states[name])
        validate_states(site.objects, states)
        return lambda: apply_states(site.objects, states)
