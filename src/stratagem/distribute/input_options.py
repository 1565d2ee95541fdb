"""InputOptions: how a distributed dataset feeds the replicas (tf.distribute.InputOptions's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputOptions:
    """``experimental_fetch_to_device``: copy each batch to the replica's GPU ahead of need, from
    pinned host memory on a side CUDA stream, so the copy overlaps the previous step's compute
    (tf's ``prefetch_to_device``); ignored on CPU replicas. ``experimental_per_replica_buffer_size``:
    how many batches are copied ahead. ``experimental_place_dataset_on_device`` and
    ``experimental_replication_mode`` are accepted with tf's defaults only (stratagem's input
    pipelines run on the host, one per replica)."""

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1
    experimental_place_dataset_on_device: bool = False
    experimental_replication_mode: str = "PER_WORKER"

    def __post_init__(self) -> None:
        if self.experimental_per_replica_buffer_size < 1:
            raise ValueError(
                "InputOptions.experimental_per_replica_buffer_size must be >= 1, got "
                f"{self.experimental_per_replica_buffer_size}"
            )
        if self.experimental_place_dataset_on_device:
            raise ValueError(
                "InputOptions(experimental_place_dataset_on_device=True) is not supported: "
                "stratagem's input pipelines run on the host; use experimental_fetch_to_device"
            )
        if str(self.experimental_replication_mode).upper().endswith("PER_REPLICA"):
            raise ValueError(
                "InputOptions(experimental_replication_mode=PER_REPLICA) is not supported; "
                "stratagem runs one input pipeline per replica process already (PER_WORKER)"
            )
