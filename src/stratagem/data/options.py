"""tf.data-style Options (determinism, autotune budget, distribution) and shared constants."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

AUTOTUNE = -1
"""Let the runtime choose a parallelism or buffer size from measured rates."""

INFINITE_CARDINALITY = -1
"""``cardinality()`` of a dataset that never ends (tf.data.INFINITE_CARDINALITY)."""
UNKNOWN_CARDINALITY = -2
"""``cardinality()`` when the length is not known without iterating (tf.data's value)."""


class AutoShardPolicy(enum.IntEnum):
    """How a distributed input pipeline is split across workers (values as in tf.data)."""

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2


class _Checked:
    """Attribute checks for the option groups: tf.data's names are accepted where stratagem
    has the feature (``_ALIASES`` maps tf's name to ours), and any other name raises an
    AttributeError naming it, instead of being stored and silently ignored."""

    _ALIASES: ClassVar[dict[str, str]] = {}
    _TF_UNSUPPORTED: ClassVar[dict[str, str]] = {}

    def _resolve(self, name: str) -> str:
        if name.startswith("_"):
            return name
        name = self._ALIASES.get(name, name)
        fields = {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        if name in fields:
            return name
        group = type(self).__name__
        if name in self._TF_UNSUPPORTED:
            raise AttributeError(
                f"{group}.{name}: tf.data has this option but stratagem does not "
                f"({self._TF_UNSUPPORTED[name]}); remove the setting"
            )
        known = sorted(fields | set(self._ALIASES))
        raise AttributeError(
            f"{group} has no option {name!r}; the options are: {', '.join(known)}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        name = self._resolve(name)
        if name == "auto_shard_policy" and value is not None:
            value = _shard_policy(value)
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:  # only called for names not found normally
        if name.startswith("__"):
            raise AttributeError(name)
        return object.__getattribute__(self, self._resolve(name))


def _shard_policy(value: Any) -> AutoShardPolicy:
    try:
        return AutoShardPolicy(int(value))
    except (ValueError, TypeError):
        raise ValueError(
            f"auto_shard_policy {value!r} is not one of OFF (-1), AUTO (0), FILE (1), DATA (2); "
            "tf.data's HINT (3) is not supported: use DATA or FILE"
        ) from None


@dataclasses.dataclass
class AutotuneOptions(_Checked):
    """Autotune settings; ``None`` means unset (the default applies)."""

    enabled: bool | None = None
    ram_budget: int | None = None  # bytes for buffered elements; default 1 GiB
    cpu_budget: int | None = None  # max worker threads/processes; default 2 x cores (min 4)

    _TF_UNSUPPORTED: ClassVar[dict[str, str]] = {
        "autotune_algorithm": "one autotune algorithm, see stratagem.data.autotune",
        "initial_parallelism": "autotune starts from the measured rates",
        "min_parallelism": "autotune starts from the measured rates",
    }


@dataclasses.dataclass
class DistributeOptions(_Checked):
    """Distribution settings; ``None`` means unset (AUTO applies)."""

    auto_shard_policy: AutoShardPolicy | None = None
    num_devices: int | None = None


_UNSUPPORTED_OPTIONS = {
    "experimental_optimization": "no graph rewrites: map/batch fusion, map parallelization "
    "and prefetch injection are what you write",
    "threading": "map(num_parallel_calls=...) and autotune.cpu_budget size the pools",
    "experimental_threading": "map(num_parallel_calls=...) and autotune.cpu_budget size the pools",
    "experimental_slack": "no slack-based prefetch scheduling",
    "experimental_external_state_policy": "no graph serialization",
    "experimental_symbolic_checkpoint": "iterator state is always the compact state_dict()",
    "experimental_warm_start": "pipelines start on the first next()",
    "experimental_stats": "no stats aggregator",
    "framework_type": "no framework telemetry",
    "dataset_name": "no dataset service",
}


@dataclasses.dataclass
class Options(_Checked):
    """Like ``tf.data.Options``: set fields then ``ds.with_options(options)``.

    ``deterministic`` (default True) lets parallel stages reorder elements when False.
    ``seed`` seeds every transformation created without its own seed (shuffle, list_files,
    map(with_rng=True)); unset, a random seed is drawn per iterator and kept in its state.
    tf.data's spellings ``experimental_deterministic`` and ``experimental_distribute`` name
    the same settings; tf.data options stratagem does not have raise an AttributeError.
    """

    deterministic: bool | None = None
    seed: int | None = None
    autotune: AutotuneOptions = dataclasses.field(default_factory=AutotuneOptions)
    distribute: DistributeOptions = dataclasses.field(default_factory=DistributeOptions)

    _ALIASES: ClassVar[dict[str, str]] = {
        "experimental_deterministic": "deterministic",
        "experimental_distribute": "distribute",
    }
    _TF_UNSUPPORTED: ClassVar[dict[str, str]] = _UNSUPPORTED_OPTIONS

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
