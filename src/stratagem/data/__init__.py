"""stratagem.data: a tf.data-style input pipeline (depends on nothing else in the package)."""

from stratagem.data.batching import BatchDataset, UnbatchDataset
from stratagem.data.cache import CacheDataset
from stratagem.data.dataset import Dataset
from stratagem.data.functions import MapFunctionError, element_rng
from stratagem.data.iterator import DatasetIterator
from stratagem.data.options import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    AutoShardPolicy,
    AutotuneOptions,
    DistributeOptions,
    Options,
)
from stratagem.data.prefetch import PipelineClosed
from stratagem.data.sharding import (
    auto_shard,
    file_sources,
    last_batch,
    rebatch_and_shard,
    shard_data,
    shard_files,
)
from stratagem.data.sources import TextLineDataset
from stratagem.data.testing import assert_resumes_exactly
from stratagem.data.tfrecord import (
    CorruptRecordError,
    TFRecordDataset,
    TFRecordWriter,
    crc32c,
    masked_crc32c,
)
from stratagem.data.torch_interop import DataLoaderView, from_torch

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "AutotuneOptions",
    "BatchDataset",
    "CacheDataset",
    "CorruptRecordError",
    "DataLoaderView",
    "Dataset",
    "DatasetIterator",
    "DistributeOptions",
    "MapFunctionError",
    "Options",
    "PipelineClosed",
    "TFRecordDataset",
    "TFRecordWriter",
    "TextLineDataset",
    "UnbatchDataset",
    "assert_resumes_exactly",
    "auto_shard",
    "crc32c",
    "element_rng",
    "file_sources",
    "from_torch",
    "last_batch",
    "masked_crc32c",
    "rebatch_and_shard",
    "shard_data",
    "shard_files",
]
