"""stratagem.data: a tf.data-style input pipeline (depends on nothing else in the package)."""

from stratagem.data.batching import BatchDataset, UnbatchDataset
from stratagem.data.cache import CacheDataset
from stratagem.data.csv import CsvDataset, CsvParseError, decode_csv, make_csv_dataset
from stratagem.data.dataset import Dataset
from stratagem.data.example import (
    ExampleParseError,
    FixedLenFeature,
    FixedLenSequenceFeature,
    VarLenFeature,
    encode_example,
    parse_example,
    parse_single_example,
)
from stratagem.data.fixed_length import FixedLengthRecordDataset
from stratagem.data.functions import MapFunctionError, element_rng
from stratagem.data.iterator import (
    DatasetIterator,
    InvalidArgumentError,
    Optional,
    OutOfRangeError,
)
from stratagem.data.mixtures import choose_from_datasets, sample_from_datasets
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
from stratagem.data.ragged import Ragged
from stratagem.data.sharding import (
    auto_shard,
    file_sources,
    last_batch,
    rebatch_and_shard,
    shard_data,
    shard_files,
    shards_by_files,
)
from stratagem.data.sources import TextLineDataset
from stratagem.data.spec import DatasetSpec, RaggedSpec, TensorSpec
from stratagem.data.testing import assert_resumes_exactly
from stratagem.data.tfrecord import (
    CorruptRecordError,
    TFRecordDataset,
    TFRecordOptions,
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
    "CsvDataset",
    "CsvParseError",
    "DataLoaderView",
    "Dataset",
    "DatasetSpec",
    "DatasetIterator",
    "DistributeOptions",
    "ExampleParseError",
    "FixedLenFeature",
    "FixedLenSequenceFeature",
    "FixedLengthRecordDataset",
    "InvalidArgumentError",
    "MapFunctionError",
    "Optional",
    "Options",
    "OutOfRangeError",
    "PipelineClosed",
    "Ragged",
    "RaggedSpec",
    "TFRecordDataset",
    "TFRecordOptions",
    "TFRecordWriter",
    "TensorSpec",
    "TextLineDataset",
    "UnbatchDataset",
    "VarLenFeature",
    "assert_resumes_exactly",
    "auto_shard",
    "choose_from_datasets",
    "crc32c",
    "decode_csv",
    "element_rng",
    "encode_example",
    "file_sources",
    "from_torch",
    "last_batch",
    "make_csv_dataset",
    "masked_crc32c",
    "parse_example",
    "parse_single_example",
    "rebatch_and_shard",
    "sample_from_datasets",
    "shard_data",
    "shard_files",
    "shards_by_files",
]
