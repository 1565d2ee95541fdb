"""auto_shard: split a pipeline across input workers by its AutoShardPolicy (a pure rewrite)."""

from __future__ import annotations

import copy
from collections.abc import Callable

from stratagem.data.batching import BatchDataset
from stratagem.data.dataset import Dataset
from stratagem.data.functions import MapFunctionError, failure_at
from stratagem.data.options import AutoShardPolicy
from stratagem.data.parallel import ParallelMapDataset
from stratagem.data.rebatch import RebatchShardDataset
from stratagem.data.shuffle import ShuffleDataset
from stratagem.data.sources import FileSource, ListFilesDataset
from stratagem.data.transforms import MapDataset


def _walk(ds: Dataset) -> list[Dataset]:
    out = [ds]
    for inp in ds._inputs:
        out.extend(_walk(inp))
    return out


def _rewrite(ds: Dataset, fn: Callable[[Dataset], Dataset | None]) -> Dataset:
    """Bottom-up rewrite: ``fn`` returns a replacement node or None to keep it."""
    inputs = tuple(_rewrite(i, fn) for i in ds._inputs)
    if any(a is not b for a, b in zip(inputs, ds._inputs)):
        ds = ds._with_inputs(inputs)
    replaced = fn(ds)
    return ds if replaced is None else replaced


def file_sources(dataset: Dataset) -> list[FileSource]:
    """The nodes of the pipeline that read a list of files (list_files, TextLine, TFRecord)."""
    return [d for d in _walk(dataset) if isinstance(d, FileSource)]


def shard_files(dataset: Dataset, num_shards: int, index: int) -> Dataset:
    """FILE policy: every file source keeps files index, index + n, ... of its sorted list."""
    sources = file_sources(dataset)
    if not sources:
        raise ValueError(
            "auto-shard policy FILE found no file-reading source (list_files, TextLineDataset, "
            "TFRecordDataset) in the pipeline; use AutoShardPolicy.DATA or read files through "
            "Dataset.list_files"
        )
    for src in sources:
        if len(src.files) < num_shards:
            raise ValueError(
                f"auto-shard policy FILE: {type(src).__name__} has {len(src.files)} files but "
                f"there are {num_shards} input workers; provide at least {num_shards} files or "
                "set Options().distribute.auto_shard_policy = AutoShardPolicy.DATA"
            )
    return _rewrite(
        dataset,
        lambda d: d.with_files(d._files[index::num_shards]) if isinstance(d, FileSource) else None,
    )


def _check_same_order(upstream: Dataset) -> None:
    if upstream.options().seed is not None:
        return
    for d in _walk(upstream):
        unseeded = d._random_order() or (isinstance(d, ShuffleDataset) and d._seed is None) or (
            isinstance(d, ListFilesDataset) and d._shuffle and d._seed is None
        )
        if unseeded:
            raise ValueError(
                f"auto-shard policy DATA needs every worker to see the same element order, but "
                f"the pipeline has an unseeded {type(d).__name__}; pass seed=... to it or set "
                "Options().seed"
            )


def shard_data(dataset: Dataset, num_shards: int, index: int) -> Dataset:
    """DATA policy: keep every ``num_shards``-th element starting at ``index``.

    The shard is placed right before the last ``batch``/``padded_batch`` of the pipeline's
    main chain (so each worker batches its own elements into full batches of the original
    size), or at the end when the pipeline does not batch.
    """
    node: Dataset | None = dataset
    batch: BatchDataset | None = None
    while node is not None:
        if isinstance(node, BatchDataset):
            batch = node
            break
        node = node._inputs[0] if len(node._inputs) == 1 else None
    if batch is None:
        _check_same_order(dataset)
        return dataset.shard(num_shards, index)
    _check_same_order(batch._inputs[0])
    target = batch
    return _rewrite(
        dataset,
        lambda d: d._with_inputs((d._inputs[0].shard(num_shards, index),)) if d is target else None,
    )


def auto_shard(dataset: Dataset, num_shards: int, index: int) -> Dataset:
    """The pipeline worker ``index`` of ``num_shards`` should run, by the dataset's policy.

    FILE: shard the file lists at their sources (a ValueError if a source has fewer files
    than workers). DATA: see :func:`shard_data`. AUTO: FILE when the pipeline reads files
    through a file source, else DATA. OFF (or ``num_shards == 1``): unchanged.
    """
    num_shards, index = int(num_shards), int(index)
    if num_shards < 1 or not 0 <= index < num_shards:
        raise ValueError(
            f"auto_shard: need num_shards >= 1 and 0 <= index < num_shards, got "
            f"num_shards={num_shards}, index={index}"
        )
    policy = dataset.options().resolved_auto_shard_policy
    if num_shards == 1 or policy == AutoShardPolicy.OFF:
        return dataset
    if policy == AutoShardPolicy.FILE:
        return shard_files(dataset, num_shards, index)
    if policy == AutoShardPolicy.AUTO and file_sources(dataset):
        return shard_files(dataset, num_shards, index)
    return shard_data(dataset, num_shards, index)


def last_batch(dataset: Dataset) -> BatchDataset | None:
    """The last ``batch``/``padded_batch`` on the pipeline's main chain, if it has one."""
    node: Dataset | None = dataset
    while node is not None:
        if isinstance(node, BatchDataset):
            return node
        node = node._inputs[0] if len(node._inputs) == 1 else None
    return None


def shards_by_files(dataset: Dataset) -> bool:
    """Whether splitting ``dataset`` over workers gives each worker its own files (the FILE
    policy, or AUTO over a file source): then which examples a worker reads depends on the
    number of workers, not only on the global batches."""
    policy = dataset.options().resolved_auto_shard_policy
    return policy == AutoShardPolicy.FILE or (policy == AutoShardPolicy.AUTO and bool(file_sources(dataset)))


def rebatch_and_shard(dataset: Dataset, num_shards: int, index: int) -> Dataset | None:
    """Worker ``index``'s pipeline when global batches of B are split over ``num_shards``.

    The last ``batch(B)`` becomes ``batch(B / num_shards)`` and the pipeline is auto-sharded by
    its policy, so each worker reads only its share. With the DATA policy worker ``i`` keeps
    its contiguous run of each global batch (tf.distribute's rebatching: ``split_sizes``), cut
    below the element-wise maps, so the union of the workers' k-th batches is exactly the k-th
    global batch, in order, and each worker maps only its own elements. None when that does not apply (one shard, policy OFF, no
    batch, or B not divisible by ``num_shards``): the caller then splits whole global batches.
    """
    if num_shards == 1 or dataset.options().resolved_auto_shard_policy == AutoShardPolicy.OFF:
        return None
    batch = last_batch(dataset)
    if batch is None or batch.batch_size % num_shards:
        return None
    smaller = copy.copy(batch)
    smaller.batch_size = batch.batch_size // num_shards
    if shards_by_files(dataset):
        rebatched = _rewrite(dataset, lambda d: smaller if d is batch else None)
        return auto_shard(rebatched, num_shards, index)
    # DATA: this worker's contiguous run of each global batch (tf's rebatching), cut below the
    # element-wise maps that need no per-element RNG, so each worker maps only its own elements
    _check_same_order(batch._inputs[0])
    maps = _maps_below(batch)
    node: Dataset = RebatchShardDataset(
        (maps[-1] if maps else batch)._inputs[0], batch.batch_size, num_shards, index
    )
    for m in reversed(maps):
        node = m._with_inputs((node,))
    new_batch = smaller._with_inputs((node,))
    return _rewrite(dataset, lambda d: new_batch if d is batch else None)


def _maps_below(batch: BatchDataset) -> list[Dataset]:
    """The chain of element-wise maps (no per-element RNG) feeding ``batch``, top down: the
    shard goes right under the last of them."""
    out: list[Dataset] = []
    below = batch._inputs[0]
    while isinstance(below, (MapDataset, ParallelMapDataset)) and not below._with_rng:
        out.append(below)
        below = below._inputs[0]
    return out


def renumbered(dataset: Dataset, error: MapFunctionError) -> MapFunctionError | None:
    """``error`` (a map function failing in worker ``i``'s pipeline that ``rebatch_and_shard``
    made) numbering the element within the whole dataset, as the user wrote it, rather than
    within the worker's share; None when it was not one of the maps above the shard, or the
    position is not known exactly."""
    if error.position is None or error.fn is None or error.what is None:
        return None
    batch = last_batch(dataset)
    if batch is None:
        return None
    maps = _maps_below(batch)
    below = (maps[-1] if maps else batch)._inputs[0]
    if not isinstance(below, RebatchShardDataset) or not any(getattr(m, "_fn", None) is error.fn for m in maps):
        return None
    position = below.source_position(error.position)
    if position is None:
        return None
    where = (
        f"element {position} of the dataset (element {error.position} of replica "
        f"{below._index}'s share of it, of {below._num_shards})"
    )
    return failure_at(error.what, error.fn, where, position, error.reason or "", error.__cause__)
