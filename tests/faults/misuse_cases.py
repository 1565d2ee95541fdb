"""The one-process fault matrix: the mistakes a new user makes with the public API (strategies,
fit / evaluate / predict, the Keras methods, tf.data's API, checkpoints), each answered by an
error of a known class that names the mistake, or handled (the case checks the result)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from matrix_kit import Outcome, Registry
from torch import nn

import stratagem as sg
from stratagem.data import Dataset, TensorSpec
from stratagem.train.checkpoint import Checkpoint, CheckpointManager

R = Registry()
err, ok = R.error, R.ok


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))


def _xy(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _fit(data: Any, *, loss: Any = None, model: nn.Module | None = None, **kw: Any) -> Any:
    model = _model() if model is None else model
    opt = kw.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return sg.fit(
        model, opt, nn.CrossEntropyLoss() if loss is None else loss, data, verbose=0, **kw
    )


def _keras(compile_: bool = True, **kw: Any) -> Any:
    torch.manual_seed(0)
    m = sg.Sequential(nn.Linear(2, 2))
    if compile_:
        m.compile(optimizer="sgd", loss="mse", **kw)
    return m


def _arrays(n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    return np.ones((n, 2), np.float32), np.ones((n, 2), np.float32)


def _one() -> sg.Strategy:
    return sg.OneDeviceStrategy("cpu")


# --- strategies ----------------------------------------------------------------------------------
@err("strategy: reduce with an unknown op", ValueError, "unknown reduce op 'bogus'", "ReduceOp.SUM")
def _(d: Path) -> object:
    return sg.get_strategy().reduce("bogus", torch.ones(2))


@err("strategy: OneDevice reduce with an unknown op", ValueError, "unknown reduce op 'MAXX'")
def _(d: Path) -> object:
    return _one().reduce("MAXX", torch.ones(2))


@err("strategy: ReduceOp of an unknown name", ValueError, "'max2' is not a valid ReduceOp")
def _(d: Path) -> object:
    return sg.ReduceOp("max2")


@err(
    "strategy: reduce along an axis the value lacks", ValueError, "reduce", "axis=3", "1 dimension"
)
def _(d: Path) -> object:
    return _one().reduce("sum", torch.ones(2), axis=3)


@err("strategy: run of something not callable", TypeError, "run", "callable", "int")
def _(d: Path) -> object:
    return _one().run(42)


@err(
    "strategy: run with args a tensor, not a tuple",
    TypeError,
    "args",
    "tuple",
    "Tensor",
    "args=(x,)",
)
def _(d: Path) -> object:
    return _one().run(lambda a: a, args=torch.ones(2))


@err("strategy: run with kwargs a list, not a dict", TypeError, "kwargs", "dict", "list")
def _(d: Path) -> object:
    return _one().run(lambda a: a, kwargs=[1])


@err("strategy: distribute a tuple of whole tensors", TypeError, "from_tensor_slices", "[16, 4]")
def _(d: Path) -> object:
    return list(_one().experimental_distribute_dataset(_xy()))


@err("strategy: distribute an int", TypeError, "experimental_distribute_dataset", "int")
def _(d: Path) -> object:
    return list(_one().experimental_distribute_dataset(42))


@err(
    "strategy: datasets from a function that is not callable",
    TypeError,
    "distribute_datasets_from_function",
    "callable",
)
def _(d: Path) -> object:
    return _one().distribute_datasets_from_function(42)


@err(
    "strategy: MirroredStrategy(num_replicas='2')",
    TypeError,
    "num_replicas",
    "'2' (str)",
    "num_replicas=2",
)
def _(d: Path) -> object:
    return sg.MirroredStrategy(num_replicas="2")


@err("strategy: MirroredStrategy(num_replicas=0)", ValueError, "num_replicas must be >= 1, got 0")
def _(d: Path) -> object:
    return sg.MirroredStrategy("cpu", num_replicas=0)


@err("strategy: MirroredStrategy('tpu')", ValueError, "unknown device 'tpu'", "TPUStrategy")
def _(d: Path) -> object:
    return sg.MirroredStrategy("tpu")


@err(
    "strategy: OneDeviceStrategy('gpu:7') without CUDA",
    ValueError,
    "gpu:7",
    "CUDA is not available",
)
def _(d: Path) -> object:
    if torch.cuda.is_available():
        raise ValueError(
            "gpu:7 CUDA is not available (this machine has CUDA: the case does not apply)"
        )
    return sg.OneDeviceStrategy("gpu:7")


@err(
    "strategy: compute_average_loss(global_batch_size=0)",
    ValueError,
    "global_batch_size must be positive, got 0",
)
def _(d: Path) -> object:
    return sg.compute_average_loss(torch.ones(4), global_batch_size=0)


@ok("strategy: compute_average_loss of a [B, k] loss", "sum / B, as tf.distribute")
def _(d: Path) -> str:
    got = float(sg.compute_average_loss(torch.ones(4, 3)))
    if got != 3.0:
        raise Outcome(
            "silent wrong", f"compute_average_loss(ones(4, 3)) = {got}, tf gives 12 / 4 = 3"
        )
    return "compute_average_loss(ones(4, 3)) = 3.0 (sum over the batch / 4), as tf's"


@ok("strategy: run(fn, args=[x]) (a list of arguments)", "fn(x)")
def _(d: Path) -> str:
    got = _one().run(lambda a: a * 2, args=[torch.ones(2)])
    if not torch.equal(got, torch.full((2,), 2.0)):
        raise Outcome("silent wrong", f"run(lambda a: a * 2, args=[ones(2)]) = {got}")
    return "run(fn, args=[x]) calls fn(x)"


# --- fit / evaluate / predict ----------------------------------------------------------------------
@err("fit: an iterator read for 2 epochs", TypeError, "data is an iterator", "read only once")
def _(d: Path) -> object:
    return _fit(iter([_xy()] * 2), epochs=2)


@err(
    "fit: an infinite dataset without steps_per_epoch",
    ValueError,
    "infinite dataset",
    "steps_per_epoch",
)
def _(d: Path) -> object:
    return _fit(Dataset.from_tensor_slices(_xy()).batch(4).repeat())


@err(
    "fit: an infinite distributed dataset without steps_per_epoch",
    ValueError,
    "infinite",
    "steps_per_epoch",
)
def _(d: Path) -> object:
    s = _one()
    with s.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = s.experimental_distribute_dataset(Dataset.from_tensor_slices(_xy()).batch(4).repeat())
    return sg.fit(model, opt, nn.CrossEntropyLoss(), data, verbose=0)


@ok("fit: an infinite dataset with steps_per_epoch", "trains that many steps")
def _(d: Path) -> str:
    seen = []

    class Count(sg.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            seen.append(batch)

    _fit(
        Dataset.from_tensor_slices(_xy()).batch(4).repeat(),
        steps_per_epoch=7,
        epochs=2,
        callbacks=[Count()],
    )
    if len(seen) != 14:
        raise Outcome("silent wrong", f"{len(seen)} steps for 2 epochs of 7")
    return "2 epochs of steps_per_epoch=7 on a repeated dataset: 14 steps"


@err("fit: epochs=-1", ValueError, "epochs must be >= 0, got -1")
def _(d: Path) -> object:
    return _fit([_xy()], epochs=-1)


@err("fit: a callback that is not a Callback", TypeError, "callbacks must be", "Callback", "object")
def _(d: Path) -> object:
    return _fit([_xy()], callbacks=[object()])


@err("fit: steps_per_epoch=0", ValueError, "steps_per_epoch must be a positive", "got 0")
def _(d: Path) -> object:
    return _fit([_xy()], steps_per_epoch=0)


@err("fit: x and y of different batch sizes", ValueError, "different batch sizes [16, 8]")
def _(d: Path) -> object:
    x, y = _xy()
    return _fit([(x, y[:8])])


@err("fit: outputs [B, 1] against targets [B]", ValueError, "[16, 1]", "[16]", "broadcasts")
def _(d: Path) -> object:
    model = nn.Linear(4, 1)
    return _fit([(_xy()[0], torch.randn(16))], loss=nn.MSELoss(), model=model)


@err("fit: inputs of the wrong feature size", RuntimeError, "16x5 and 4x8")
def _(d: Path) -> object:
    return _fit([(torch.randn(16, 5), _xy()[1])])


@err("fit: an unknown loss name", ValueError, "unknown loss 'nosuchloss'", "mse")
def _(d: Path) -> object:
    return _fit([_xy()], loss="nosuchloss")


@err("fit: an unknown metric name", ValueError, "unknown metric 'nosuchmetric'", "accuracy")
def _(d: Path) -> object:
    return _fit([_xy()], metrics=["nosuchmetric"])


@err("fit: verbose=7", ValueError, "verbose must be", "got 7")
def _(d: Path) -> object:
    model = _model()
    return sg.fit(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        [_xy()],
        verbose=7,
    )


@err("fit: class_weight keyed by a string", TypeError, "class_weight", "'a'")
def _(d: Path) -> object:
    return _fit([_xy()], loss=nn.CrossEntropyLoss(reduction="none"), class_weight={"a": 1.0})


@err("fit: clipnorm=-1", ValueError, "clipnorm must be > 0, got -1.0")
def _(d: Path) -> object:
    return _fit([_xy()], clipnorm=-1.0)


@err(
    "fit: gradient_accumulation_steps=0",
    ValueError,
    "gradient_accumulation_steps must be a positive integer, got 0",
)
def _(d: Path) -> object:
    return _fit([_xy()], gradient_accumulation_steps=0)


@err("fit: a sample_weight of another batch size", ValueError, "different batch sizes [16, 16, 5]")
def _(d: Path) -> object:
    x, y = _xy()
    return _fit([(x, y, torch.ones(5))], loss=nn.CrossEntropyLoss(reduction="none"))


@err("fit: precision='float8'", ValueError, "unknown precision 'float8'", "bf16")
def _(d: Path) -> object:
    return _fit([_xy()], precision="float8")


@err(
    "fit: lr_scheduler_interval='minute'",
    ValueError,
    "lr_scheduler_interval must be 'step'",
    "'minute'",
)
def _(d: Path) -> object:
    return _fit([_xy()], lr_scheduler_interval="minute")


@err(
    "fit: batches that are bare tensors", ValueError, "each batch must be a tuple (x, y)", "Tensor"
)
def _(d: Path) -> object:
    return _fit([_xy()[0]])


@err(
    "fit: the optimizer of another model", ValueError, "optimizer", "none of the model's parameters"
)
def _(d: Path) -> object:
    return _fit([_xy()], optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


@err("fit: float targets for CrossEntropyLoss", RuntimeError, "target dtype", "Long")
def _(d: Path) -> object:
    x, y = _xy()
    return _fit([(x, y.float())])


@err("fit: int64 inputs into a float model", RuntimeError, "Long and Float")
def _(d: Path) -> object:
    x, y = _xy()
    return _fit([(x.long(), y)])


@ok("fit: initial_epoch past epochs", "no training, an empty History")
def _(d: Path) -> str:
    model = _model()
    before = [p.clone() for p in model.parameters()]
    h = _fit([_xy()], model=model, epochs=1, initial_epoch=3)
    if h.history or any(not torch.equal(a, b) for a, b in zip(before, model.parameters())):
        raise Outcome("silent wrong", f"trained: {h.history}")
    return "fit(epochs=1, initial_epoch=3): nothing trained, History empty (Keras's behaviour)"


@err("fit: no batch at all (an empty list)", ValueError, "fit read no batch in epoch 1", "empty")
def _(d: Path) -> object:
    return _fit([])


@err("fit: a dataset whose drop_remainder drops everything", ValueError, "fit read no batch", "drop_remainder")
def _(d: Path) -> object:
    x, y = _xy(3)
    return _fit(Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True))


@err("fit: empty validation_data", ValueError, "fit's validation_data gave no batch")
def _(d: Path) -> object:
    return _fit([_xy()], validation_data=[])


@err("evaluate: no batch at all", ValueError, "evaluate's data gave no batch")
def _(d: Path) -> object:
    return sg.evaluate(_model(), nn.CrossEntropyLoss(), [])


@ok("fit: numpy float64 through a distributed dataset", "cast to float32 as fit casts")
def _(d: Path) -> str:
    s = _one()
    batches = list(s.experimental_distribute_dataset([(np.ones((4, 4)), np.zeros(4, np.int64))]))
    dtype = batches[0][0].dtype
    if dtype != torch.float32:
        raise Outcome("silent wrong", f"a float64 numpy batch reached the model as {dtype}")
    return "numpy float64 batch -> torch.float32"


@err("evaluate: an infinite dataset without steps", ValueError, "infinite dataset", "steps")
def _(d: Path) -> object:
    return sg.evaluate(
        _model(), nn.CrossEntropyLoss(), Dataset.from_tensor_slices(_xy()).batch(4).repeat()
    )


@err("predict: an infinite dataset without steps", ValueError, "infinite dataset", "steps")
def _(d: Path) -> object:
    return sg.predict(_model(), Dataset.from_tensor_slices(_xy()[0]).batch(4).repeat())


@err("predict: inputs of the wrong feature size", RuntimeError, "4x7 and 4x8")
def _(d: Path) -> object:
    return sg.predict(_model(), [torch.randn(4, 7)])


@ok("evaluate: a finite dataset with steps=2", "reads 2 batches")
def _(d: Path) -> str:
    model = _model()
    x, y = _xy()
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)]
    got = sg.evaluate(model, nn.CrossEntropyLoss(), batches, steps=2)
    want = float(nn.CrossEntropyLoss()(model(x[:8]), y[:8]))
    if abs(got - want) > 1e-5:
        raise Outcome("silent wrong", f"evaluate(steps=2) = {got}, the first 2 batches give {want}")
    return f"evaluate(steps=2) = {got:.5f}, the mean over the first 2 batches"


# --- the Keras methods -----------------------------------------------------------------------------
@err("keras: compile(optimizer='nosuchopt')", ValueError, "unknown optimizer 'nosuchopt'", "adam")
def _(d: Path) -> object:
    return _keras(False).compile(optimizer="nosuchopt", loss="mse")


@err("keras: compile(loss='nosuchloss')", ValueError, "unknown loss 'nosuchloss'")
def _(d: Path) -> object:
    return _keras(False).compile(optimizer="sgd", loss="nosuchloss")


@err("keras: compile(metrics=['nosuch'])", ValueError, "unknown metric 'nosuch'")
def _(d: Path) -> object:
    return _keras(False).compile(optimizer="sgd", loss="mse", metrics=["nosuch"])


@err("keras: compile(loss_weights='x') with one loss", ValueError, "loss_weights 'x'", "one loss")
def _(d: Path) -> object:
    return _keras(False).compile(optimizer="sgd", loss="mse", loss_weights="x")


@err("keras: compile(steps_per_execution=0)", ValueError, "steps_per_execution", "0")
def _(d: Path) -> object:
    return _keras(steps_per_execution=0).fit(*_arrays(), verbose=0)


@err("keras: fit before compile", RuntimeError, "compile()", "fit")
def _(d: Path) -> object:
    return _keras(False).fit(torch.ones(4, 2), torch.ones(4, 2), verbose=0)


@err("keras: validation_split=1.5", ValueError, "validation_split must be in (0, 1), got 1.5")
def _(d: Path) -> object:
    return _keras().fit(*_arrays(), validation_split=1.5, verbose=0)


@err("keras: validation_split with a dataset", ValueError, "validation_split", "not a dataset")
def _(d: Path) -> object:
    data = Dataset.from_tensor_slices((torch.ones(8, 2), torch.ones(8, 2))).batch(4)
    return _keras().fit(data, validation_split=0.2, verbose=0)


@err("keras: x and y of different lengths", ValueError, "same number of rows", "x: [8], y: [7]")
def _(d: Path) -> object:
    return _keras().fit(np.ones((8, 2), np.float32), np.ones((7, 2), np.float32), verbose=0)


@err("keras: x of numpy object dtype", TypeError, "numpy.object_")
def _(d: Path) -> object:
    return _keras().fit(np.array([[1, "a"]] * 8, dtype=object), _arrays()[1], verbose=0)


@ok("keras: numpy float64 arrays", "cast to float32, trained")
def _(d: Path) -> str:
    m = _keras()
    h = m.fit(np.ones((8, 2)), np.ones((8, 2)), verbose=0)
    loss = h.history["loss"][0]
    if not np.isfinite(loss):
        raise Outcome("silent wrong", f"loss {loss}")
    return f"float64 arrays trained as float32: loss {loss:.4f}"


@err("keras: batch_size=0", ValueError, "batch_size must be a positive integer", "got 0")
def _(d: Path) -> object:
    return _keras().fit(*_arrays(), batch_size=0, verbose=0)


@err("keras: sample_weight of another length", ValueError, "sample_weight: [5]")
def _(d: Path) -> object:
    return _keras().fit(*_arrays(), sample_weight=np.ones(5), verbose=0)


@err("keras: batch_size with a dataset", ValueError, "batch_size is for array inputs")
def _(d: Path) -> object:
    data = Dataset.from_tensor_slices((torch.ones(8, 2), torch.ones(8, 2))).batch(4)
    return _keras().fit(data, batch_size=4, verbose=0)


@err("keras: y with a dataset", ValueError, "`y` argument is not supported when using a dataset")
def _(d: Path) -> object:
    data = Dataset.from_tensor_slices((torch.ones(8, 2), torch.ones(8, 2))).batch(4)
    return _keras().fit(data, np.ones(8), verbose=0)


@err(
    "keras: a plain function as a callback",
    TypeError,
    "callbacks must be",
    "builtin_function_or_method",
)
def _(d: Path) -> object:
    return _keras().fit(*_arrays(), callbacks=[print], verbose=0)


@err(
    "keras: validation_data of one array",
    ValueError,
    "validation_data must be (x_val, y_val)",
    "tuple of 1",
)
def _(d: Path) -> object:
    return _keras().fit(*_arrays(), validation_data=(np.ones((4, 3), np.float32),), verbose=0)


@err("keras: shuffle='sometimes'", ValueError, "shuffle", "'sometimes'")
def _(d: Path) -> object:
    return _keras().fit(*_arrays(), shuffle="sometimes", verbose=0)


@err("keras: load_model of a missing file", FileNotFoundError, "nope.keras does not exist")
def _(d: Path) -> object:
    return sg.load_model(d / "nope.keras")


@err("keras: load_model of a text file", ValueError, "t.keras")
def _(d: Path) -> object:
    (d / "t.keras").write_text("hello")
    return sg.load_model(d / "t.keras")


@err(
    "keras: load_model of a directory of junk",
    FileNotFoundError,
    "junk",
    "no config.json",
    "load_weights",
)
def _(d: Path) -> object:
    (d / "junk").mkdir()
    (d / "junk" / "x").write_text("1")
    return sg.load_model(d / "junk")


@err("keras: save into a directory that cannot be made", OSError, "/proc/nope")
def _(d: Path) -> object:
    return _keras().save("/proc/nope/m.keras")


@err("keras: save over an existing file with overwrite=False", FileExistsError, "overwrite=False")
def _(d: Path) -> object:
    (d / "m.keras").write_text("x")
    return _keras().save(d / "m.keras", overwrite=False)


@ok("keras: save then load_model", "the same predictions")
def _(d: Path) -> str:
    m = _keras()
    m.fit(*_arrays(), verbose=0)
    m.save(d / "m.keras")
    back = sg.load_model(d / "m.keras", model=sg.Sequential(nn.Linear(2, 2)))
    x = torch.randn(3, 2)
    if not torch.equal(m(x), back(x)):
        raise Outcome("silent wrong", "the loaded model predicts otherwise")
    return "load_model(save(m)) predicts as m, bit for bit"


# --- tf.data's API -----------------------------------------------------------------------------------
@err(
    "data: from_tensor_slices of mismatched lengths",
    ValueError,
    "from_tensor_slices",
    "sizes [3, 4]",
)
def _(d: Path) -> object:
    return Dataset.from_tensor_slices((torch.ones(3), torch.ones(4)))


@err("data: a map function that raises", sg.data.MapFunctionError, "element 2", "ZeroDivisionError")
def _(d: Path) -> object:
    def f(e: Any) -> Any:
        if int(e) == 2:
            raise ZeroDivisionError("boom")
        return e

    return list(Dataset.range(5).map(f))


@err("data: a parallel map function that raises", sg.data.MapFunctionError, "element 3", "KeyError")
def _(d: Path) -> object:
    def f(e: Any) -> Any:
        if int(e) == 3:
            raise KeyError("label")
        return e

    return list(Dataset.range(6).map(f, num_parallel_calls=2))


@err("data: batch(0)", ValueError, "batch_size must be >= 1, got 0")
def _(d: Path) -> object:
    return Dataset.range(5).batch(0)


def _ragged() -> Dataset:
    return Dataset.from_generator(
        lambda: iter([torch.ones(2), torch.ones(5)]),
        output_signature=TensorSpec((None,), torch.float32),
    )


@err("data: batch of elements of different shapes", ValueError, "(2,)", "(5,)", "padded_batch")
def _(d: Path) -> object:
    return list(_ragged().batch(2))


@err("data: padded_batch to a shape too small", ValueError, "size 5", "padded shape [3]")
def _(d: Path) -> object:
    return list(_ragged().padded_batch(2, padded_shapes=(3,)))


@ok("data: padded_batch of elements of different shapes", "padded with zeros")
def _(d: Path) -> str:
    (b,) = list(_ragged().padded_batch(2))
    if tuple(b.shape) != (2, 5) or float(b.sum()) != 7.0:
        raise Outcome("silent wrong", f"padded batch {b}")
    return "padded_batch: [2, 5], the short element zero-padded"


@err("data: shuffle(0)", ValueError, "buffer_size must be >= 1, got 0")
def _(d: Path) -> object:
    return Dataset.range(5).shuffle(0)


@err("data: shard index out of range", ValueError, "index must be in [0, 2)", "got 2")
def _(d: Path) -> object:
    return Dataset.range(5).shard(2, 2)


@err("data: shard(0, 0)", ValueError, "num_shards must be >= 1, got 0")
def _(d: Path) -> object:
    return Dataset.range(5).shard(0, 0)


@err("data: window(0)", ValueError, "window", "size=0")
def _(d: Path) -> object:
    return Dataset.range(5).window(0)


@err("data: prefetch(-5)", ValueError, "prefetch", "got -5")
def _(d: Path) -> object:
    return Dataset.range(5).prefetch(-5)


@err("data: unbatch of scalars", ValueError, "unbatch", "scalar")
def _(d: Path) -> object:
    return list(Dataset.range(5).unbatch())


@err("data: zip of a list", TypeError, "zip expects Datasets", "list")
def _(d: Path) -> object:
    return Dataset.zip((Dataset.range(3), [1, 2]))


@err("data: a filter predicate that is not a scalar", ValueError, "filter", "shape [3]")
def _(d: Path) -> object:
    return list(Dataset.range(5).filter(lambda e: torch.ones(3)))


@err(
    "data: interleave returning a list",
    TypeError,
    "interleave",
    "must return a stratagem Dataset",
    "list",
)
def _(d: Path) -> object:
    return list(Dataset.range(3).interleave(lambda e: [e]))


@err("data: flat_map returning a list", TypeError, "flat_map", "must return a stratagem Dataset")
def _(d: Path) -> object:
    return list(Dataset.range(3).flat_map(lambda e: [e]))


@err("data: from_generator of an iterator", TypeError, "from_generator expects a callable")
def _(d: Path) -> object:
    return Dataset.from_generator(iter([1, 2]))


@err(
    "data: from_generator against its output_signature",
    ValueError,
    "element 0",
    "shape (3,)",
    "TensorSpec(shape=(2,)",
)
def _(d: Path) -> object:
    return list(
        Dataset.from_generator(
            lambda: iter([torch.ones(3)]), output_signature=TensorSpec((2,), torch.float32)
        )
    )


@err("data: get_single_element of 3", ValueError, "more than one element")
def _(d: Path) -> object:
    return Dataset.range(3).get_single_element()


@err("data: get_single_element of none", ValueError, "the dataset is empty")
def _(d: Path) -> object:
    return Dataset.range(0).get_single_element()


@err("data: cache to a path that cannot be written", OSError, "/proc/nope/cache")
def _(d: Path) -> object:
    return list(Dataset.range(3).cache("/proc/nope/cache"))


@err("data: TextLineDataset of a missing file", FileNotFoundError, "/nonexistent/file.txt")
def _(d: Path) -> object:
    return list(sg.data.TextLineDataset("/nonexistent/file.txt"))


@err("data: TFRecordDataset of a missing file", FileNotFoundError, "/nonexistent/f.tfrecord")
def _(d: Path) -> object:
    return list(sg.data.TFRecordDataset("/nonexistent/f.tfrecord"))


@err("data: TFRecordDataset(compression_type='LZ4')", ValueError, "compression_type 'LZ4'", "GZIP")
def _(d: Path) -> object:
    return sg.data.TFRecordDataset(str(d / "x"), compression_type="LZ4")


@err(
    "data: assert_cardinality that does not hold",
    ValueError,
    "ended after 3 elements",
    "asserted to be 5",
)
def _(d: Path) -> object:
    return list(Dataset.range(3).assert_cardinality(5))


@err(
    "data: reduce with a function of one argument",
    sg.data.MapFunctionError,
    "reduce function failed",
    "takes 1 positional",
)
def _(d: Path) -> object:
    return Dataset.range(3).reduce(0, lambda a: a)


@err("data: list_files that match nothing", ValueError, "no files match", "*.nope")
def _(d: Path) -> object:
    return list(Dataset.list_files(str(d / "*.nope")))


@err("data: rebatch(0)", ValueError, "batch_size must be >= 1, got 0")
def _(d: Path) -> object:
    return Dataset.range(8).batch(4).rebatch(0)


@ok("data: repeat(2) of a shuffled dataset", "every element twice")
def _(d: Path) -> str:
    got = sorted(int(v) for v in Dataset.range(5).shuffle(5, seed=1).repeat(2))
    if got != sorted(list(range(5)) * 2):
        raise Outcome("silent wrong", f"got {got}")
    return "shuffle(5).repeat(2): each of 5 elements twice"


@ok("data: an iterator read past its end", "StopIteration, then again StopIteration")
def _(d: Path) -> str:
    it = iter(Dataset.range(3))
    got = [int(v) for v in it]
    for _ in range(2):
        try:
            next(it)
        except StopIteration:
            continue
        raise Outcome("silent wrong", "an exhausted iterator gave another element")
    if got != [0, 1, 2]:
        raise Outcome("silent wrong", f"got {got}")
    return "[0, 1, 2], then StopIteration on every next()"


# --- checkpoints -------------------------------------------------------------------------------------
def _ckpt(d: Path, model: nn.Module | None = None, **kw: Any) -> CheckpointManager:
    torch.manual_seed(0)
    return CheckpointManager(
        Checkpoint(model=nn.Linear(2, 2) if model is None else model), d / "ckpts", **kw
    )


@err("checkpoint: save(-1)", ValueError, "non-negative int, got -1", "ckpt--1")
def _(d: Path) -> object:
    return _ckpt(d).save(-1)


@err("checkpoint: save(2.5)", TypeError, "non-negative int, got 2.5 (float)")
def _(d: Path) -> object:
    return _ckpt(d).save(2.5)


@err("checkpoint: save('3')", TypeError, "got '3' (str)")
def _(d: Path) -> object:
    return _ckpt(d).save("3")


@err("checkpoint: save(True)", TypeError, "got True (bool)")
def _(d: Path) -> object:
    return _ckpt(d).save(True)


@err("checkpoint: max_to_keep=0", ValueError, "max_to_keep must be >= 1 or None, got 0")
def _(d: Path) -> object:
    return _ckpt(d, max_to_keep=0)


@err("checkpoint: restore of a missing path", sg.CheckpointCorruptError, "nope", "not a directory")
def _(d: Path) -> object:
    return _ckpt(d).restore(d / "nope")


@err(
    "checkpoint: restore of an empty directory",
    sg.CheckpointCorruptError,
    "metadata.json",
    "missing",
)
def _(d: Path) -> object:
    (d / "empty").mkdir()
    return _ckpt(d).restore(d / "empty")


@ok("checkpoint: restore_or_initialize of an empty directory", "None, the model as initialized")
def _(d: Path) -> str:
    model = nn.Linear(2, 2)
    m = _ckpt(d, model)
    before = [p.clone() for p in model.parameters()]
    got = m.restore_or_initialize()
    if got is not None or m.latest is not None:
        raise Outcome("silent wrong", f"restored {got}, latest {m.latest}")
    if any(not torch.equal(a, b) for a, b in zip(before, model.parameters())):
        raise Outcome("silent wrong", "the model changed")
    return "restore_or_initialize() of a new directory: None, latest None"


@err("checkpoint: a directory path that is a file", ValueError, "afile is a file, not a directory")
def _(d: Path) -> object:
    (d / "afile").write_text("x")
    return CheckpointManager(Checkpoint(model=nn.Linear(2, 2)), d / "afile").save(1)


@err("checkpoint: Checkpoint() of nothing", ValueError, "needs at least one object")
def _(d: Path) -> object:
    return sg.Checkpoint()


@err(
    "checkpoint: load_state_dict of a missing directory",
    FileNotFoundError,
    "nope",
    "no checkpoint that verifies",
)
def _(d: Path) -> object:
    from stratagem.train.checkpoint import load_state_dict

    return load_state_dict(d / "nope")


@ok(
    "checkpoint: newest broken, restore_or_initialize falls back", "the one before, latest names it"
)
def _(d: Path) -> str:
    m = _ckpt(d)
    m.save(1)
    m.save(2)
    (d / "ckpts" / "ckpt-2" / "metadata.json").write_text("{")
    m.close()
    back = _ckpt(d)
    got = back.restore_or_initialize()
    if got is None or not str(got).endswith("ckpt-1") or not str(back.latest).endswith("ckpt-1"):
        raise Outcome("silent wrong", f"restored {got}, latest {back.latest}")
    return "ckpt-2 broken: restored ckpt-1, latest = ckpt-1"


@ok("checkpoint: save, change, restore", "the saved weights back")
def _(d: Path) -> str:
    model = nn.Linear(2, 2)
    m = _ckpt(d, model)
    saved = [p.clone() for p in model.parameters()]
    m.save(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    m.restore(m.latest)
    if any(not torch.equal(a, b) for a, b in zip(saved, model.parameters())):
        raise Outcome("silent wrong", "restore did not bring the saved weights back")
    return "ckpt-5 restored: the weights as saved"


SPECS = R.specs
