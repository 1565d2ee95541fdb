"""The Dataset plan (an immutable graph of nodes) and its tf.data-named fluent methods."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from stratagem.data.iterator import Context, DatasetIterator, StatefulIterator
from stratagem.data.options import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Options,
)


class Dataset:
    """A tf.data-style dataset: a plan; iterating it builds a runtime (a DatasetIterator).

    Subclasses set ``_inputs`` and implement ``_make_iterator`` and ``_cardinality``.
    Every ``iter(ds)`` starts a new epoch (reshuffling where asked) without ``set_epoch``.
    """

    _inputs: tuple[Dataset, ...] = ()

    # -- plan protocol ---------------------------------------------------------------
    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        raise NotImplementedError

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _with_inputs(self, inputs: Sequence[Dataset]) -> Dataset:
        clone = copy.copy(self)
        clone._inputs = tuple(inputs)
        clone._epochs_started = 0
        return clone

    def _own_options(self) -> Options | None:
        return None

    # -- iteration -------------------------------------------------------------------
    def __iter__(self) -> DatasetIterator:
        epoch = getattr(self, "_epochs_started", 0)
        self._epochs_started = epoch + 1
        return DatasetIterator(self, epoch=epoch)

    def iterator(self, epoch: int | None = None, seed: int | None = None) -> DatasetIterator:
        """An iterator for an explicit epoch (and seed for unseeded randomness)."""
        if epoch is None:
            return iter(self)
        return DatasetIterator(self, epoch=epoch, seed=seed)

    def iterator_from_state(self, state: dict[str, Any]) -> DatasetIterator:
        """A fresh iterator restored from ``state`` (see DatasetIterator.state_dict)."""
        epoch = state.get("epoch", 0) if isinstance(state, dict) else 0
        it = DatasetIterator(self, epoch=int(epoch) if isinstance(epoch, int) else 0, seed=0)
        it.load_state_dict(state)
        return it

    def cardinality(self) -> int:
        """Number of elements, INFINITE_CARDINALITY (-1) or UNKNOWN_CARDINALITY (-2)."""
        return self._cardinality()

    def __len__(self) -> int:
        n = self.cardinality()
        if n < 0:
            kind = "infinite" if n == INFINITE_CARDINALITY else "unknown"
            raise TypeError(
                f"len() of a dataset with {kind} cardinality; use take(n) or iterate instead"
            )
        return n

    def options(self) -> Options:
        """The options of this pipeline: those of its inputs merged with its own."""
        merged = Options()
        for inp in self._inputs:
            merged = merged.merge(inp.options())
        own = self._own_options()
        return merged.merge(own) if own is not None else merged

    def __repr__(self) -> str:
        return f"<{type(self).__name__} cardinality={self.cardinality()}>"

    # -- sources -------------------------------------------------------------------
    @staticmethod
    def range(*args: int) -> Dataset:
        from stratagem.data.sources import RangeDataset

        return RangeDataset(*args)

    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        from stratagem.data.sources import TensorSlicesDataset

        return TensorSlicesDataset(tensors)

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        from stratagem.data.sources import TensorsDataset

        return TensorsDataset(tensors)

    @staticmethod
    def from_generator(
        generator: Callable[..., Iterable[Any]],
        output_types: Any = None,
        output_shapes: Any = None,
        args: tuple | None = None,
        output_signature: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """Elements of ``generator(*args)``. ``output_signature`` (a structure of
        TensorSpec) converts and checks each element; tf's older ``output_types`` and
        ``output_shapes`` make the same signature (arguments in tf's order)."""
        from stratagem.data.sources import GeneratorDataset, signature_from

        del name
        if output_signature is not None and output_types is not None:
            raise TypeError(
                "from_generator: give output_signature or output_types/output_shapes, not both"
            )
        signature = output_signature
        if output_types is not None:
            signature = signature_from(output_types, output_shapes)
        elif output_shapes is not None:
            raise TypeError("from_generator: output_shapes needs output_types")
        return GeneratorDataset(generator, tuple(args or ()), signature)

    @staticmethod
    def list_files(
        file_pattern: str | Sequence[str], shuffle: bool | None = None, seed: int | None = None
    ) -> Dataset:
        from stratagem.data.sources import ListFilesDataset

        return ListFilesDataset(file_pattern, shuffle=shuffle, seed=seed)

    @staticmethod
    def zip(*datasets: Any) -> Dataset:
        from stratagem.data.transforms import ZipDataset

        if len(datasets) == 1 and isinstance(datasets[0], tuple | dict):
            return ZipDataset(datasets[0])
        return ZipDataset(tuple(datasets))

    @staticmethod
    def from_torch(torch_dataset: Any, num_parallel_calls: int | None = None) -> Dataset:
        from stratagem.data.torch_interop import from_torch

        return from_torch(torch_dataset, num_parallel_calls=num_parallel_calls)

    # -- transformations -------------------------------------------------------------
    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        *,
        with_rng: bool = False,
        seed: int | None = None,
        use_processes: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """Apply ``map_func`` to each element (tuples are unpacked into arguments).

        ``num_parallel_calls`` (an int or AUTOTUNE) runs it in parallel: with AUTOTUNE and
        ``use_processes`` unset, on threads or processes as measured (logged once); with
        ``use_processes=True`` on worker processes (forked on Linux; elsewhere
        ``map_func`` must be picklable), ``False`` on threads. Worker processes feeding a
        ``batch`` build whole batches in shared memory. ``with_rng=True`` passes ``rng=``,
        a ``numpy.random.Generator`` seeded from (seed, epoch, element index), so random
        transforms do not depend on the number of threads or processes.
        """
        if num_parallel_calls is None and not use_processes:
            from stratagem.data.transforms import MapDataset

            return MapDataset(self, map_func, with_rng=with_rng, seed=seed, name=name)
        from stratagem.data.parallel import ParallelMapDataset

        return ParallelMapDataset(
            self,
            map_func,
            num_parallel_calls if num_parallel_calls is not None else AUTOTUNE,
            deterministic,
            with_rng=with_rng,
            seed=seed,
            use_processes=use_processes,
            name=name,
        )

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        from stratagem.data.transforms import FilterDataset

        return FilterDataset(self, predicate)

    def flat_map(self, map_func: Callable[..., Dataset]) -> Dataset:
        from stratagem.data.interleave import InterleaveDataset

        return InterleaveDataset(self, map_func, 1, 1, None, None)

    def interleave(
        self,
        map_func: Callable[..., Dataset],
        cycle_length: int | None = None,
        block_length: int | None = None,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> Dataset:
        from stratagem.data.interleave import InterleaveDataset

        return InterleaveDataset(
            self, map_func, cycle_length, block_length, num_parallel_calls, deterministic
        )

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> Dataset:
        from stratagem.data.batching import BatchDataset

        del num_parallel_calls, deterministic  # batching is cheap; accepted for tf parity
        return BatchDataset(self, batch_size, drop_remainder)

    def padded_batch(
        self,
        batch_size: int,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
    ) -> Dataset:
        from stratagem.data.batching import BatchDataset

        return BatchDataset(
            self, batch_size, drop_remainder, padded=True,
            padded_shapes=padded_shapes, padding_values=padding_values,
        )

    def unbatch(self) -> Dataset:
        from stratagem.data.batching import UnbatchDataset

        return UnbatchDataset(self)

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        from stratagem.data.shuffle import ShuffleDataset

        return ShuffleDataset(self, buffer_size, seed, reshuffle_each_iteration)

    def repeat(self, count: int | None = None) -> Dataset:
        from stratagem.data.transforms import RepeatDataset

        return RepeatDataset(self, count)

    def take(self, count: int) -> Dataset:
        from stratagem.data.transforms import TakeDataset

        return TakeDataset(self, count)

    def skip(self, count: int) -> Dataset:
        from stratagem.data.transforms import SkipDataset

        return SkipDataset(self, count)

    def shard(self, num_shards: int, index: int) -> Dataset:
        from stratagem.data.transforms import ShardDataset

        return ShardDataset(self, num_shards, index)

    def enumerate(self, start: int = 0) -> Dataset:
        from stratagem.data.transforms import EnumerateDataset

        return EnumerateDataset(self, start)

    def concatenate(self, dataset: Dataset) -> Dataset:
        from stratagem.data.transforms import ConcatenateDataset

        return ConcatenateDataset(self, dataset)

    def cache(self, filename: str = "") -> Dataset:
        from stratagem.data.cache import CacheDataset

        return CacheDataset(self, filename)

    def prefetch(self, buffer_size: int = AUTOTUNE) -> Dataset:
        from stratagem.data.prefetch import PrefetchDataset

        return PrefetchDataset(self, buffer_size)

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        out = transformation_func(self)
        if not isinstance(out, Dataset):
            raise TypeError(
                f"apply() expects a function returning a Dataset, got {type(out).__name__}"
            )
        return out

    def with_options(self, options: Options) -> Dataset:
        from stratagem.data.transforms import OptionsDataset

        if not isinstance(options, Options):
            raise TypeError(f"with_options expects stratagem.data.Options, got {options!r}")
        return OptionsDataset(self, options)

    # -- interop ---------------------------------------------------------------------
    def as_dataloader(self) -> Any:
        """A view with ``__iter__``, ``__len__``, ``batch_size`` and ``dataset``, for code
        that expects a ``torch.utils.data.DataLoader``."""
        from stratagem.data.torch_interop import DataLoaderView

        return DataLoaderView(self)

    def as_numpy_iterator(self) -> Any:
        from stratagem.data.torch_interop import to_numpy

        return (to_numpy(e) for e in self)

    # -- tf.data entry points added for issue 15 (see docs/TFDATA_COVERAGE.md) ----------
    def _random_order(self) -> bool:
        """True when this node's element order comes from an unseeded random choice (DATA
        auto-sharding then needs a seed, or workers would disagree on the order)."""
        return False

    def _spec(self) -> Any:
        """The element spec this node knows without running (None: not known)."""
        return None

    @property
    def element_spec(self) -> Any:
        """The structure of the elements with a TensorSpec/RaggedSpec per leaf: from the
        plan where it is known (sources, output_signature, batch), else from the first
        element."""
        from stratagem.data.spec import element_spec

        return element_spec(self)

    @staticmethod
    def counter(start: int = 0, step: int = 1) -> Dataset:
        from stratagem.data.sources import CounterDataset

        return CounterDataset(start, step)

    @staticmethod
    def random(seed: int | None = None, rerandomize_each_iteration: bool | None = None
               ) -> Dataset:
        from stratagem.data.sources import RandomDataset

        return RandomDataset(seed, rerandomize_each_iteration)

    @staticmethod
    def sample_from_datasets(
        datasets: Sequence[Dataset],
        weights: Any = None,
        seed: int | None = None,
        stop_on_empty_dataset: bool = False,
        rerandomize_each_iteration: bool | None = None,
    ) -> Dataset:
        from stratagem.data.mixtures import sample_from_datasets

        return sample_from_datasets(
            datasets, weights, seed, stop_on_empty_dataset, rerandomize_each_iteration
        )

    @staticmethod
    def choose_from_datasets(
        datasets: Sequence[Dataset], choice_dataset: Dataset, stop_on_empty_dataset: bool = True
    ) -> Dataset:
        from stratagem.data.mixtures import choose_from_datasets

        return choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset)

    @staticmethod
    def load(
        path: str,
        element_spec: Any = None,
        compression: str | None = None,
        reader_func: Callable[[Dataset], Dataset] | None = None,
    ) -> Dataset:
        from stratagem.data.saved import load

        return load(path, element_spec, compression, reader_func)

    def save(
        self,
        path: str,
        compression: str | None = None,
        shard_func: Callable[..., Any] | None = None,
        checkpoint_args: Any = None,
    ) -> None:
        from stratagem.data.saved import save

        save(self, path, compression, shard_func, checkpoint_args)

    def snapshot(
        self,
        path: str,
        compression: str | None = "AUTO",
        reader_func: Callable[[Dataset], Dataset] | None = None,
        shard_func: Callable[..., Any] | None = None,
    ) -> Dataset:
        from stratagem.data.saved import SnapshotDataset

        return SnapshotDataset(self, path, compression, reader_func, shard_func)

    def window(
        self, size: int, shift: int | None = None, stride: int = 1, drop_remainder: bool = False
    ) -> Dataset:
        from stratagem.data.windowing import WindowDataset

        return WindowDataset(self, size, shift, stride, drop_remainder)

    def group_by_window(
        self,
        key_func: Callable[..., Any],
        reduce_func: Callable[[int, Dataset], Dataset],
        window_size: int | None = None,
        window_size_func: Callable[[int], Any] | None = None,
    ) -> Dataset:
        from stratagem.data.windowing import GroupByWindowDataset

        return GroupByWindowDataset(self, key_func, reduce_func, window_size, window_size_func)

    def bucket_by_sequence_length(
        self,
        element_length_func: Callable[..., Any],
        bucket_boundaries: Sequence[int],
        bucket_batch_sizes: Sequence[int],
        padded_shapes: Any = None,
        padding_values: Any = None,
        pad_to_bucket_boundary: bool = False,
        no_padding: bool = False,
        drop_remainder: bool = False,
    ) -> Dataset:
        from stratagem.data.windowing import bucket_by_sequence_length

        return bucket_by_sequence_length(
            self, element_length_func, list(bucket_boundaries), list(bucket_batch_sizes),
            padded_shapes, padding_values, pad_to_bucket_boundary, no_padding, drop_remainder,
        )

    def ragged_batch(
        self, batch_size: int, drop_remainder: bool = False, row_splits_dtype: Any = None
    ) -> Dataset:
        """Batch elements of different lengths into :class:`Ragged` values (row splits are
        always int64)."""
        from stratagem.data.ragged_batch import RaggedBatchDataset

        del row_splits_dtype
        return RaggedBatchDataset(self, batch_size, drop_remainder)

    def rejection_resample(
        self,
        class_func: Callable[..., Any],
        target_dist: Any,
        initial_dist: Any = None,
        seed: int | None = None,
    ) -> Dataset:
        from stratagem.data.mixtures import rejection_resample

        return rejection_resample(self, class_func, target_dist, initial_dist, seed)

    def scan(self, initial_state: Any, scan_func: Callable[..., Any]) -> Dataset:
        from stratagem.data.scan import ScanDataset

        return ScanDataset(self, initial_state, scan_func)

    def take_while(self, predicate: Callable[..., Any]) -> Dataset:
        from stratagem.data.scan import TakeWhileDataset

        return TakeWhileDataset(self, predicate)

    def unique(self) -> Dataset:
        from stratagem.data.scan import UniqueDataset

        return UniqueDataset(self)

    def reduce(self, initial_state: Any, reduce_func: Callable[..., Any]) -> Any:
        from stratagem.data.scan import reduce

        return reduce(self, initial_state, reduce_func)

    def get_single_element(self) -> Any:
        from stratagem.data.scan import get_single_element

        return get_single_element(self)

    def ignore_errors(self, log_warning: bool = False) -> Dataset:
        from stratagem.data.ignore_errors import IgnoreErrorsDataset

        return IgnoreErrorsDataset(self, log_warning)

    def rebatch(self, batch_size: int | Sequence[int], drop_remainder: bool = False) -> Dataset:
        from stratagem.data.sized_batches import rebatch

        return rebatch(self, batch_size, drop_remainder)

    def sparse_batch(self, batch_size: int, row_shape: Sequence[int]) -> Dataset:
        """Batches as torch sparse COO tensors (tf's SparseTensor layout)."""
        from stratagem.data.sized_batches import SparseBatchDataset

        return SparseBatchDataset(self, batch_size, row_shape)

    def assert_cardinality(self, expected_cardinality: int) -> Dataset:
        from stratagem.data.transforms import AssertCardinalityDataset

        return AssertCardinalityDataset(self, expected_cardinality)

