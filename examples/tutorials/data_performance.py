"""TensorFlow's guide "Better performance with the tf.data API", in stratagem.data.

The guide's ArtificialDataset (a generator whose "file" takes a while to open and whose
samples take a while to read) and its ``benchmark`` (a training step that also takes a while),
then each technique of the guide against the naive pipeline: prefetching, parallel
interleave, parallel map, caching and vectorized map. Sleeps are shorter than the guide's so
it runs in a few seconds: ``python examples/tutorials/data_performance.py``. Each line prints
the time of the technique next to the naive one; the speed-ups are the guide's point.
"""

import time

import numpy as np

import stratagem.data as sgd

OPEN_S, READ_S, STEP_S, MAP_S = 0.03, 0.004, 0.004, 0.004


class ArtificialDataset:
    @staticmethod
    def _generator(num_samples):
        time.sleep(OPEN_S)  # opening the file
        for sample_idx in range(num_samples):
            time.sleep(READ_S)  # reading data (line, record) from the file
            yield np.array([sample_idx])  # tf: `yield (sample_idx,)` (a tuple is a structure here)

    def __new__(cls, num_samples=3):
        return sgd.Dataset.from_generator(
            cls._generator,
            output_signature=sgd.TensorSpec(shape=(1,), dtype="int64"),
            args=(num_samples,),
        )


def benchmark(dataset, num_epochs=2):
    start_time = time.perf_counter()
    for _epoch_num in range(num_epochs):
        for _sample in dataset:
            time.sleep(STEP_S)  # performing a training step
    return time.perf_counter() - start_time


def mapped_function(s):
    time.sleep(MAP_S)  # do some hard pre-processing
    return s


results = {}
# the naive approach
results["naive"] = benchmark(ArtificialDataset())
# prefetching: overlap the producer and the consumer
results["prefetch"] = benchmark(ArtificialDataset().prefetch(sgd.AUTOTUNE))
# sequential interleave vs parallel interleave
results["sequential interleave"] = benchmark(sgd.Dataset.range(2).interleave(lambda _: ArtificialDataset()))
results["parallel interleave"] = benchmark(
    sgd.Dataset.range(2).interleave(lambda _: ArtificialDataset(), num_parallel_calls=sgd.AUTOTUNE)
)
# sequential mapping vs parallel mapping
results["sequential map"] = benchmark(ArtificialDataset().map(mapped_function))
results["parallel map"] = benchmark(ArtificialDataset().map(mapped_function, num_parallel_calls=sgd.AUTOTUNE))
# caching: the second epoch reads the cache, not the file and the map
results["cache"] = benchmark(ArtificialDataset().map(mapped_function).cache(), 5)
results["no cache"] = benchmark(ArtificialDataset().map(mapped_function), 5)


# vectorizing mapping: one call per batch instead of one per element
def increment(x):
    time.sleep(0.0001)  # a fixed cost per call: vectorizing pays it once per batch
    return x + 1


fast_dataset = sgd.Dataset.range(1000)
results["scalar map"] = benchmark(fast_dataset.map(increment).batch(256), 1)
results["vectorized map"] = benchmark(fast_dataset.batch(256).map(increment), 1)

for name, seconds in results.items():
    print(f"{name:>22}: {seconds:.3f} s")
pairs = [("naive", "prefetch"), ("sequential interleave", "parallel interleave"),
         ("sequential map", "parallel map"), ("no cache", "cache"), ("scalar map", "vectorized map")]  # fmt: skip
print("speed-ups: " + ", ".join(f"{b} {results[a] / results[b]:.1f}x" for a, b in pairs))
assert np.isfinite(list(results.values())).all()
