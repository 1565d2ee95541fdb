"""PipelineExtended: the engine of PipelineStrategy: stages over a pipeline communicator, copies
of the pipeline over a replica communicator (a DataParallelExtended without mirroring)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from stratagem.comm import Communicator
from stratagem.comm.mesh import JobMesh
from stratagem.core.mesh import DATA, PIPELINE
from stratagem.distribute import context, ownership
from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.engines.fsdp import ShardingOptions, apply_fsdp
from stratagem.distribute.engines.layout import LayoutMap
from stratagem.distribute.engines.over_replicas import OverReplicas
from stratagem.distribute.strategy import Execution, ReplicaContext, StateLayout
from stratagem.pipeline.config import PipelineConfig
from stratagem.pipeline.errors import PipelineConfigError
from stratagem.pipeline.materialize import flatten, has_meta, materialize
from stratagem.pipeline.microbatch import loss_reduction_of
from stratagem.pipeline.p2p import Channel
from stratagem.pipeline.partition import Partition, block_partition, check_balance
from stratagem.pipeline.pipe import Pipe
from stratagem.pipeline.profile import param_costs, time_costs
from stratagem.pipeline.schedule import Schedule
from stratagem.pipeline.stage import Stage, describe
from stratagem.pipeline.ties import Tie, TiedGradients, find_ties
from stratagem.pipeline.timeline import Recorder, Timeline


class PipelineExtended(OverReplicas):
    """Stages over a pipeline communicator; copies of the pipeline over a replica communicator."""

    def __init__(
        self,
        config: PipelineConfig,
        job: JobMesh,
        upstream: Communicator | None = None,
        *,
        sharding: ShardingOptions | None = None,
        layout_map: LayoutMap | None = None,
    ) -> None:
        self.config = config
        self.sharding = sharding  # each stage's layers sharded over its copies (FSDP), or None
        self.layout_map = layout_map if config.tensor_parallel > 1 else None  # each stage's layers split (TP)
        self.job = job  # the job's mesh (config.mesh: data x pipeline [x model]) and its groups
        self.plans: list[dict[str, str]] = []  # the tensor-parallel plan of each layer of the last pipeline()
        self.upstream_comm = upstream  # the pipeline's ranks again, for messages to a lower stage
        self._world = world = job.world
        self.pipeline_comm = job.comm(PIPELINE)
        self.data_axes = job.layout.data_axes(DATA)  # the copies: "data", or HSDP's two
        self.replicas = replicas = job.comm(*self.data_axes)
        self._device = device = job.device
        self.stage = config.stage_of(world.rank)
        self.copy = config.copy_of(world.rank)
        self.schedule: Schedule = config.make_schedule()
        self.partition: Partition | None = None
        self._dp = DataParallelExtended(replicas, device, mirror=False, name="PipelineStrategy")
        self._rng_state: torch.Tensor | None = None
        self._capture = 0
        self._stages: list[Stage] = []  # the chunks the last pipeline() built
        self.ties: list[Tie] = []  # its weights tied across stages (checkpoints write them once)

    # --- facts ------------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self.config.data_parallel

    @property
    def replica_id(self) -> int:
        return self.copy

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def should_checkpoint(self) -> bool:
        """Copy 0 of every stage writes (each stage holds different parameters)."""
        return self.copy == 0

    @property
    def world(self) -> Communicator:
        return self._world

    @property
    def execution(self) -> Execution:
        return Execution.PIPELINE

    @property
    def state_layout(self) -> StateLayout:
        return StateLayout.PER_RANK

    def barrier(self) -> None:
        self._world.barrier()

    # --- scope: modules built here keep their parameters on the meta device -------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        if self._capture:
            yield
            return
        from torch.nn.modules import module as module_mod

        def on_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> Any:
            if not self._capture or param is None or param.device.type == "meta":
                return None
            if isinstance(param, nn.parameter.UninitializedParameter):
                return None
            if self._rng_state is None:
                self._rng_state = torch.get_rng_state()
            meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            ownership.claim(meta, self.owner())
            return meta

        handle = module_mod.register_module_parameter_registration_hook(on_parameter)
        self._capture = 1
        try:
            yield
        finally:
            self._capture = 0
            handle.remove()

    @contextlib.contextmanager
    def _no_capture(self) -> Iterator[None]:
        saved, self._capture = self._capture, 0
        try:
            yield
        finally:
            self._capture = saved

    # --- run and reductions (across data-parallel copies) ------------------------------------------
    def call_for_replica(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        ctx = ReplicaContext(self.owner(), self.copy)
        if self.layout_map is None:
            with context.replica_scope(ctx):
                return fn(*args, **kwargs)
        from torch.distributed.tensor.experimental import implicit_replication

        # split layers' outputs (DTensors) meet the model's own plain tensors as replicated
        # DTensors, as under ModelParallelStrategy
        with context.replica_scope(ctx), implicit_replication():
            return fn(*args, **kwargs)

    # --- building the local stage --------------------------------------------------------------------
    def _partition(self, layers: list[tuple[str, nn.Module]], sample_input: Any) -> Partition:
        cfg = self.config
        names = tuple(n for n, _ in layers)
        parts = cfg.num_chunks
        if len(layers) < parts:
            what = (
                f"{cfg.num_stages} stages" if cfg.virtual_stages == 1 else
                f"{cfg.num_stages} stages x {cfg.virtual_stages} virtual stages = {parts} chunks"
            )  # fmt: skip
            raise PipelineConfigError(
                f"the model has {len(layers)} layers (after flattening nested nn.Sequential) but "
                f"there are {what}; every {'stage' if cfg.virtual_stages == 1 else 'chunk'} needs "
                "at least one layer"
            )
        if isinstance(cfg.balance, tuple):
            counts = check_balance(cfg.balance, len(layers), parts)
            return Partition(tuple(counts), "balance", names, (), cfg.virtual_stages)
        if cfg.balance == "params":
            costs = param_costs(layers)
        else:
            if sample_input is None:
                raise PipelineConfigError(
                    "balance='time' profiles every layer on a sample input; pass "
                    "strategy.pipeline(model, loss_fn, sample_input=x[:micro_batch_size])"
                )
            mine = time_costs(layers, sample_input) if self._world.rank == 0 else None
            costs = self._world.broadcast_object(mine, src=0)
        balance = block_partition(costs, parts)
        return Partition(tuple(balance), cfg.balance, names, tuple(costs), cfg.virtual_stages)

    def build_pipe(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        loss_reduction: str | None,
        sample_input: Any,
        verbose: bool,
    ) -> Pipe:
        cfg = self.config
        reduction = loss_reduction_of(loss_fn, loss_reduction)
        if isinstance(loss_fn, nn.Module) and any(
            t.device.type == "meta" for t in (*loss_fn.parameters(), *loss_fn.buffers())
        ):
            raise PipelineConfigError(
                "the loss function has parameters on the meta device (it was built in "
                "strategy.scope()); build the loss function outside the scope"
            )
        layers = flatten(model)
        rng_state, self._rng_state = self._rng_state, None
        with self._no_capture(), torch.device(self._device):
            partition = self._partition(layers, sample_input)
            chunks = [partition.layers(c) for c in cfg.chunks_of(self.stage)]
            owned = chunks[0] if len(chunks) == 1 else cast(range, [j for r in chunks for j in r])
            descriptions = [describe(m) for _, m in layers]
            rank_of = [c % cfg.num_stages for c in range(cfg.num_chunks) for _ in partition.layers(c)]
            ties = find_ties(layers, rank_of)
            if ties and any(has_meta(m) for _, m in layers):
                raise PipelineConfigError(
                    f"the model ties parameters across stages ({'; '.join(map(str, ties))}) and was "
                    "built on the meta device (in strategy.scope()), where replaying each layer's "
                    "reset_parameters() would give each end its own values; build the model outside "
                    "strategy.scope() on the CPU (each process then briefly holds the whole model)"
                )
            if ties and self.layout_map is not None:
                split = [n for tie in ties for n in tie.names if self.layout_map[n] is not None]
                if split:
                    raise PipelineConfigError(
                        f"the layout map splits {', '.join(split)}, a weight tied across stages "
                        f"({'; '.join(map(str, ties))}): a tie of split weights is not built yet; leave it "
                        "whole in the layout map (its gradients are then summed across the stages as usual)"
                    )
            materialize(layers, owned, self._device, rng_state)
            if isinstance(loss_fn, nn.Module):
                loss_fn.to(self._device)
            stages = [
                Stage(
                    c, cfg.num_chunks, [layers[j][1] for j in r], r.start,
                    [n for n, _ in layers], descriptions, self._device, loss_fn,
                )  # fmt: skip
                for c, r in zip(cfg.chunks_of(self.stage), chunks)
            ]
            modules = nn.ModuleList([st.module for st in stages])
            if self.replicas.world_size > 1:
                tensors = [*modules.parameters(), *modules.buffers()]
                self.replicas.broadcast_tensors_([t.data for t in tensors], src=0)
            if self.layout_map is not None:
                self._split(stages, [layers[j][0] for r in chunks for j in r])
            if self.sharding is not None:
                self._shard(stages)
            channel = Channel(self.pipeline_comm, upstream=self.upstream_comm) if cfg.num_stages > 1 else None
            tied = (
                TiedGradients(ties, layers, owned, self.stage, self._world, self.config.pipeline_groups())
                if ties else None
            )  # fmt: skip
            pipe = Pipe(
                model, stages, channel, self.schedule, partition,
                rematerialize=cfg.rematerialize, loss_reduction=reduction, replicas=self.replicas,
                tied=tied, sharded=self.sharding is not None, pipeline=self.pipeline_comm,
            )  # fmt: skip
        for t in (*modules.parameters(), *modules.buffers()):
            ownership.claim(t, self.owner())
        self.partition = partition
        self._stages = stages
        self.ties = ties
        if verbose and self._world.rank == 0:
            print(f"stratagem PipelineStrategy: {partition}", flush=True)
            for tie in ties:
                print(f"stratagem PipelineStrategy: tied across stages, gradients summed: {tie}", flush=True)
        return pipe

    def _shard(self, stages: Sequence[Stage]) -> None:
        """Shard every layer of this process's stages over the stage's copies (the job mesh's
        data axis, whose group is the replica communicator's; with tensor parallelism beside the
        tensor axis its layers are split along: FSDP x TP): each layer with parameters is FSDP's unit
        and root (a stage runs its layers one by one), with ``sharding``'s options; gradients are
        summed across the copies (reduce-scattered at each micro-batch's backward and
        accumulated in the shards)."""
        assert self.sharding is not None
        mesh = self.job.torch[self.data_axes]  # 1-D: FSDP; replicate x shard: HSDP
        for st in stages:
            for layer in st.layers:
                if any(True for _ in layer.parameters()):
                    apply_fsdp(layer, mesh, self.sharding)

    def _split(self, stages: Sequence[Stage], names: Sequence[str]) -> None:
        """Split every layer of this process's stages over its tensor-parallel processes as the
        layout map says (the map's patterns match the whole model's parameter names, as under
        ModelParallelStrategy): torch's ``parallelize_module``, column-wise and row-wise styles,
        over the tensor axis of the job's torch mesh; the rest stays whole on every process."""
        from stratagem.distribute.engines.layout import tensor_parallel_plan
        from stratagem.distribute.engines.tensor_parallel import split_layers

        assert self.layout_map is not None
        cfg = self.config
        mesh = self.job.torch[cfg.tensor_axis]
        layers = [layer for st in stages for layer in st.layers]
        self.plans = []  # the last pipeline()'s
        for name, layer in zip(names, layers):
            plan = tensor_parallel_plan(layer, self.layout_map, cfg.tensor_axis, prefix=f"{name}.")
            self.plans.append({f"{name}.{path}" if path else name: kind for path, kind in plan.items()})
            split_layers(layer, plan, mesh)

    # --- the timeline ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def profile(self, path: str | os.PathLike[str] | None, picture: bool) -> Iterator[Timeline]:
        stages = self._stages
        if not stages:
            raise RuntimeError(
                "strategy.profile() records the pipeline's steps: build it first with "
                "pipe = strategy.pipeline(model, loss_fn)"
            )
        if stages[0].recorder is not None:
            raise RuntimeError("strategy.profile() is already recording; profiles do not nest")
        timeline = Timeline(self.schedule.name, self.config.num_stages, self.config.num_microbatches)
        recorder = Recorder()
        for st in stages:
            st.recorder = recorder
        try:
            yield timeline
        finally:
            for st in stages:
                st.recorder = None
        # every stage of this copy gets every stage's events; copy 0's stage 0 writes the files
        timeline.stages = list(self.pipeline_comm.all_gather_object(recorder.events))
        if path is not None and self._world.rank == 0:
            base = Path(path)
            timeline.trace_path = timeline.write_trace(base.with_name(base.name + ".json"))
            if picture:
                timeline.png_path = timeline.plot(base.with_name(base.name + ".png"))
