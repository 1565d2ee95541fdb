"""PipelineStrategy: a model split into stages, one process each (times data-parallel copies),
trained with GPipe, 1F1B, zero-bubble or interleaved 1F1B schedules over point-to-point messages.

Launch works as for MirroredStrategy: a plain ``python train.py`` re-runs itself to start the
other ``num_stages x data_parallel - 1`` processes; under torchrun or ``stratagem run`` it joins
the job. Rank ``r`` runs stage ``r % num_stages`` of copy ``r // num_stages``. A "replica" in the
tf.distribute sense is one copy of the whole pipeline: ``num_replicas_in_sync == data_parallel``,
and ``reduce``/``gather``/``experimental_distribute_dataset`` work across copies (every stage of a
copy sees the same slice of the global batch).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any, final

import torch
from torch import nn

from stratagem.core.mesh import DATA, PIPELINE
from stratagem.core.warn import warn_user
from stratagem.distribute.engines.fsdp import ShardingOptions
from stratagem.distribute.engines.layout import LayoutMap
from stratagem.distribute.engines.pipeline import PipelineExtended
from stratagem.distribute.startup import start
from stratagem.distribute.strategy import Strategy
from stratagem.pipeline.config import PipelineConfig
from stratagem.pipeline.errors import PipelineConfigError
from stratagem.pipeline.partition import Partition
from stratagem.pipeline.pipe import Pipe
from stratagem.pipeline.schedule import Schedule
from stratagem.pipeline.timeline import Timeline


@final
class PipelineStrategy(Strategy):
    """GPipe pipeline parallelism: ``num_stages`` processes, each holding consecutive layers of an
    ``nn.Sequential``, times ``data_parallel`` copies of the pipeline.

    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"zero_bubble"`` or ``"interleaved_1f1b"`` (with
    ``virtual_stages`` v chunks per process, default 2: the model is cut into ``num_stages x v``
    chunks, process ``s`` holding chunks ``s, s + num_stages, ...``; ``"zero_bubble"`` takes
    ``virtual_stages`` > 1 too); ``rematerialize``: ``"auto"`` (default: keep every
    micro-batch's activations while they fit half the memory available, else recompute the fewest
    micro-batches that makes them fit; decided on each process after its first step, which runs as
    ``"except_last"``), ``"always"``, ``"except_last"`` or ``"never"`` (torchgpipe's
    re-materialization modes); ``balance``: a list of
    layer counts per stage, ``"params"`` (default) or ``"time"``. ``devices``: as for
    MirroredStrategy (None: a GPU per process when there are enough, else the CPU; ``"cpu"``). ``timeout`` bounds every
    communication (seconds). ``sharding``: ``ShardingOptions(...)`` shards each stage's layers over
    its ``data_parallel`` copies (FSDP: every copy holds 1/``data_parallel`` of its stage's
    parameters, gradients and optimizer state) instead of each copy holding them whole; None
    (default) keeps whole copies. ``layout_map``: a ``stratagem.LayoutMap`` (Keras 3's) whose
    mesh has a ``model_axis`` of T processes splits each stage's layers over T processes as
    ModelParallelStrategy does (pipeline x tensor): the job has ``num_stages x data_parallel x
    T`` processes. See docs/PIPELINE.md.
    """

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        *,
        schedule: str = "gpipe",
        rematerialize: str = "auto",
        balance: Sequence[int] | str | None = None,
        data_parallel: int = 1,
        timeout: float = 120.0,
        devices: str | Sequence[str] | None = None,
        checkpoint: str | None = None,
        virtual_stages: int | None = None,
        sharding: ShardingOptions | None = None,
        layout_map: LayoutMap | None = None,
        model_axis: str = "model",
    ) -> None:
        if checkpoint is not None:
            warn_user(
                "PipelineStrategy(checkpoint=...) is now rematerialize=... (activation "
                "recomputation; checkpoints saved to disk are stratagem.Checkpoint)",
                DeprecationWarning,
                stacklevel=2,
            )
            rematerialize = checkpoint
        tensor = _tensor_degree(layout_map, model_axis, num_stages, data_parallel)
        config = PipelineConfig.build(
            num_stages, num_microbatches, schedule=schedule, rematerialize=rematerialize,
            balance=balance, data_parallel=data_parallel, virtual_stages=virtual_stages,
            tensor_parallel=tensor, tensor_axis=model_axis,
        )  # fmt: skip
        _check_sharding(sharding, config)
        started = start("PipelineStrategy", devices, timeout=timeout, mesh=config.mesh, check_world=config.check_world)
        # HSDP inside each stage: the copies cut into data_replicate x data_shard (ranks unchanged)
        layout = config.mesh.with_hsdp(DATA, sharding.shard_size) if sharding is not None else config.mesh
        env, device, job = started.spec, started.device, started.mesh(layout)
        # the pipeline's ranks again, for the messages that go to a lower stage (see p2p.Channel):
        # torch's mesh has one group per axis, so this second one is made by hand
        upstream = job.world.split(config.pipeline_groups()) if config.num_stages > 1 else None
        self.cluster_spec = env
        self.config = config
        self.device = device
        self._pipeline_ext = PipelineExtended(config, job, upstream, sharding=sharding, layout_map=layout_map)
        super().__init__(self._pipeline_ext)

    # --- pipeline facts -----------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.config.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.config.num_microbatches

    @property
    def stage(self) -> int:
        """The stage this process runs."""
        return self._pipeline_ext.stage

    @property
    def schedule(self) -> Schedule:
        """The plan every stage carries out (``print(strategy.schedule)``)."""
        return self._pipeline_ext.schedule

    @property
    def partition(self) -> Partition | None:
        """The layers of each stage, once ``pipeline()`` has chosen them."""
        return self._pipeline_ext.partition

    def pipeline(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        *,
        loss_reduction: str | None = None,
        sample_input: Any = None,
        verbose: bool = True,
    ) -> Pipe:
        """This process's stage of ``model`` (an ``nn.Sequential``; nested ones are flattened).

        Call it on every process. Layers built in ``strategy.scope()`` have their parameters on
        the meta device; each stage materializes only its own, initialised exactly as the unsplit
        model built from the same RNG state. ``loss_reduction`` (``"mean"``/``"sum"``) defaults to
        ``loss_fn.reduction``; ``sample_input`` (a micro-batch) is needed for ``balance="time"``.
        The partition is printed once (rank 0) unless ``verbose=False``.
        """
        return self._pipeline_ext.build_pipe(model, loss_fn, loss_reduction, sample_input, verbose)

    def profile(
        self, path: str | os.PathLike[str] | None = "pipeline_timeline", *, picture: bool = True
    ) -> contextlib.AbstractContextManager[Timeline]:
        """Record what every stage does in the training steps run inside ``with``::

            with strategy.profile("timeline") as timeline:
                for x, y in batches:
                    strategy.run(pipe.train_step, args=(x, y))
            print(timeline.summary())  # bubble measured vs (K-1)/(M+K-1)

        On exit (on every process) the stages' events are gathered: ``timeline`` holds them on
        every stage, and rank 0 writes ``path + ".json"`` (a Chrome trace: chrome://tracing or
        ui.perfetto.dev) and, with ``picture``, ``path + ".png"`` (needs matplotlib); ``path=None``
        writes nothing. Call it on every process, after ``pipeline()``. See docs/PIPELINE.md.
        """
        return self._pipeline_ext.profile(path, picture)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"PipelineStrategy(num_stages={c.num_stages}, num_microbatches={c.num_microbatches}, "
            f"schedule={c.schedule!r}, "
            + (f"virtual_stages={c.virtual_stages}, " if c.virtual_stages > 1 else "")
            + f"rematerialize={c.rematerialize!r}, data_parallel={c.data_parallel}"
            + (f", tensor_parallel={c.tensor_parallel}" if c.tensor_parallel > 1 else "")
            + (f", sharding={self._pipeline_ext.sharding!r})" if self._pipeline_ext.sharding is not None else ")")
        )


def _check_sharding(sharding: object, config: PipelineConfig) -> None:
    """What ``sharding=`` can be with this pipeline, or a PipelineConfigError saying why not."""
    if sharding is None:
        return
    if not isinstance(sharding, ShardingOptions):
        raise PipelineConfigError(
            f"sharding must be a stratagem.ShardingOptions (or None), got {type(sharding).__name__}: "
            f"{sharding!r}"
        )
    if config.data_parallel < 2:
        raise PipelineConfigError(
            f"sharding shards each stage over its data-parallel copies, and data_parallel="
            f"{config.data_parallel} leaves one copy: pass data_parallel >= 2 (the processes are "
            "num_stages x data_parallel), or leave sharding=None"
        )
    if config.schedule == "zero_bubble":
        raise PipelineConfigError(
            "sharding does not take schedule='zero_bubble' yet: its split backward (input "
            "gradients, then weight gradients) runs outside FSDP's backward hooks; use 'gpipe', "
            "'1f1b' or 'interleaved_1f1b'"
        )
    if sharding.gradient_op != "sum":
        raise PipelineConfigError(
            "sharding=ShardingOptions(...) under PipelineStrategy sums gradients across the copies "
            f"(the loss is scaled by the pipeline); leave gradient_op='sum' (got {sharding.gradient_op!r})"
        )
    size = sharding.shard_size
    if size is not None and (not isinstance(size, int) or size < 1 or config.data_parallel % size):
        raise PipelineConfigError(
            f"sharding=ShardingOptions(shard_size={size!r}) shards each stage within groups of "
            f"shard_size of its {config.data_parallel} copies (HSDP inside a stage): it must divide "
            "data_parallel; or leave it None to shard over all the copies"
        )


def _tensor_degree(layout_map: object, axis: str, num_stages: object, data_parallel: object) -> int:
    """The processes each stage is split over: the size of ``layout_map``'s mesh along ``axis``
    (1 without a map), or a PipelineConfigError saying what is wrong with the map."""
    if layout_map is None:
        return 1
    if not isinstance(layout_map, LayoutMap):
        raise PipelineConfigError(
            f"layout_map must be a stratagem.LayoutMap (or None), got {type(layout_map).__name__}: {layout_map!r}"
        )
    mesh = layout_map.mesh
    if axis not in mesh.axis_names:
        raise PipelineConfigError(
            f"the layout map's mesh ({mesh}) has no axis {axis!r} to split the layers along: make it "
            f"e.g. DeviceMesh((2,), ({axis!r},)), or pass model_axis= its name"
        )
    expected = {DATA: data_parallel, PIPELINE: num_stages}
    for name, n in zip(mesh.axis_names, mesh.shape):
        if name == axis:
            continue
        if name not in expected or expected[name] != n:
            raise PipelineConfigError(
                f"the layout map's mesh ({mesh}) has an axis {name!r} of {n}: under PipelineStrategy "
                f"its mesh names the tensor axis {axis!r}, and optionally 'data' (= data_parallel="
                f"{data_parallel}) and 'pipeline' (= num_stages={num_stages})"
            )
    return mesh.axis_size(axis)
