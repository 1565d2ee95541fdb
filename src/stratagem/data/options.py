"""tf.data-style Options (determinism, autotune budget, distribution) and shared constants."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

AUTOTUNE = -1
"""Let the runtime choose a parallelism or buffer size from measured rates."""

INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2


class AutoShardPolicy(enum.IntEnum):
    """How a distributed input pipeline is split across workers (values as in tf.data)."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


@dataclasses.dataclass
class AutotuneOptions:
    """Autotune settings; ``None`` means unset (the default applies)."""

    enabled: bool | None = None
    ram_budget: int | None = None  # bytes for buffered elements; default 1 GiB
    cpu_budget: int | None = None  # max worker threads/processes; default 2 x cores (min 4)


@dataclasses.dataclass
class DistributeOptions:
    """Distribution settings; ``None`` means unset (AUTO applies)."""

    auto_shard_policy: AutoShardPolicy | None = None
    num_devices: int | None = None


@dataclasses.dataclass
class Options:
    """Like ``tf.data.Options``: set fields then ``ds.with_options(options)``.

    ``deterministic`` (default True) lets parallel stages reorder elements when False.
    ``seed`` seeds every transformation created without its own seed (shuffle, list_files,
    map(with_rng=True)); unset, a random seed is drawn per iterator and kept in its state.
    """

    deterministic: bool | None = None
    seed: int | None = None
    autotune: AutotuneOptions = dataclasses.field(default_factory=AutotuneOptions)
    distribute: DistributeOptions = dataclasses.field(default_factory=DistributeOptions)

    def merge(self, other: Options) -> Options:
        """A new Options: fields set in ``other`` override those set here."""
        return _merge(self, other)

    # resolved values ----------------------------------------------------------------
    @property
    def resolved_deterministic(self) -> bool:
        return True if self.deterministic is None else bool(self.deterministic)

    @property
    def resolved_ram_budget(self) -> int:
        return self.autotune.ram_budget or (1 << 30)

    @property
    def resolved_cpu_budget(self) -> int:
        import os

        return self.autotune.cpu_budget or max(4, 2 * (os.cpu_count() or 1))

    @property
    def resolved_auto_shard_policy(self) -> AutoShardPolicy:
        return self.distribute.auto_shard_policy or AutoShardPolicy.AUTO


def _merge(a: Any, b: Any) -> Any:
    out = dataclasses.replace(a)
    for f in dataclasses.fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(va):
            setattr(out, f.name, _merge(va, vb))
        elif vb is not None:
            setattr(out, f.name, vb)
    return out
