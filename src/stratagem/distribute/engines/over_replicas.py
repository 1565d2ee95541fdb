"""OverReplicas: the replica collectives and input of engines that run copies over a
DataParallelExtended (pipeline copies, sharded and tensor-parallel replicas), written once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from stratagem.distribute.engines.data_parallel import DataParallelExtended
from stratagem.distribute.reduce_op import ReduceOp
from stratagem.distribute.strategy import StrategyExtended


class OverReplicas(StrategyExtended):
    """An engine whose reductions, gathers, merges and distributed input are those of its
    data-parallel engine ``self._dp`` across the replicas (copies) of the model."""

    _dp: DataParallelExtended

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        return self._dp.all_reduce(op, value)

    def reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        return self._dp.reduce(op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        return self._dp.gather(value, axis)

    def merge_values(self, value: Any) -> list[Any]:
        return self._dp.merge_values(value)

    def distribute_dataset(self, dataset: Iterable[Any], options: Any) -> Iterable[Any]:
        return self._dp.distribute_dataset(dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[Any], Iterable[Any]], options: Any
    ) -> Iterable[Any]:
        return self._dp.distribute_datasets_from_function(dataset_fn, options)
