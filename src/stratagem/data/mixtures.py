"""Mixing and rebalancing sources: choose_from_datasets, sample_from_datasets,
rejection_resample.

As in tf.data, ``sample_from_datasets`` is ``choose_from_datasets`` driven by a selector
dataset of random indices, and ``rejection_resample`` is built from map/filter/scan and
``sample_from_datasets``. Random draws are seeded from (seed, epoch, draw block), so a seeded mixture is
the same in every run and its resume state is just positions. The
draws differ from TensorFlow's (its stateless multinomial kernel is not reproduced).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from stratagem.data.dataset import Dataset
from stratagem.data.iterator import Context, StatefulIterator
from stratagem.data.options import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY


def _as_index(value: Any) -> int:
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        if np.ndim(value) != 0:
            raise ValueError(
                f"choose_from_datasets: choice_dataset must yield scalar integers, got shape "
                f"{tuple(np.shape(value))}"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"choose_from_datasets: choice_dataset must yield integers, got "
            f"{type(value).__name__}"
        )
    return int(value)


class DirectedInterleaveDataset(Dataset):
    """Output element i is the next element of ``datasets[choice_i]``. An exhausted input's
    choices are skipped (or end the output with ``stop_on_empty_dataset``); the output ends
    with the choices or when every input is exhausted."""

    def __init__(
        self, selector: Dataset, datasets: Sequence[Dataset], stop_on_empty_dataset: bool
    ) -> None:
        datasets = list(datasets)
        if not datasets:
            raise ValueError("choose_from_datasets: datasets must not be empty")
        for i, d in enumerate(datasets):
            if not isinstance(d, Dataset):
                raise TypeError(
                    f"choose_from_datasets: datasets[{i}] is a {type(d).__name__}, not a Dataset"
                )
        if not isinstance(selector, Dataset):
            raise TypeError(
                f"choose_from_datasets: choice_dataset must be a Dataset of integers, got "
                f"{type(selector).__name__}"
            )
        self._inputs = (selector, *datasets)
        self._stop = bool(stop_on_empty_dataset)
        self._unseeded = False  # set by sample_from_datasets without a seed

    def _random_order(self) -> bool:
        return self._unseeded

    def _cardinality(self) -> int:
        # tf.data's rule: infinite as soon as one input is (whatever the selector)
        ns = [d.cardinality() for d in self._inputs[1:]]
        return INFINITE_CARDINALITY if INFINITE_CARDINALITY in ns else UNKNOWN_CARDINALITY

    def _spec(self) -> Any:
        from stratagem.data.spec import generalize, static_spec

        specs = [static_spec(d) for d in self._inputs[1:]]
        if any(s is None for s in specs):
            return None
        out = specs[0]
        for s in specs[1:]:
            out = generalize(out, s)
        return out

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return _DirectedIterator(self, ctx)


class _DirectedIterator(StatefulIterator):
    def __init__(self, ds: DirectedInterleaveDataset, ctx: Context) -> None:
        self.ds = ds
        self.children = [d._make_iterator(ctx.child(i)) for i, d in enumerate(ds._inputs)]
        self.active = [True] * (len(ds._inputs) - 1)
        self.done = False

    def __next__(self) -> Any:
        while not self.done:
            try:
                choice = _as_index(next(self.children[0]))
            except StopIteration:
                self.done = True
                break
            if not 0 <= choice < len(self.active):
                raise ValueError(
                    f"choose_from_datasets: selector index {choice} is out of range for "
                    f"{len(self.active)} datasets"
                )
            if not self.active[choice]:
                continue
            try:
                return next(self.children[1 + choice])
            except StopIteration:
                if self.ds._stop:
                    self.done = True
                    break
                self.active[choice] = False
                if not any(self.active):
                    self.done = True
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"inputs": [c.state_dict() for c in self.children], "active": list(self.active),
                "done": self.done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for c, s in zip(self.children, state["inputs"]):
            c.load_state_dict(s)
        self.active = [bool(a) for a in state["active"]]
        self.done = bool(state["done"])


def choose_from_datasets(
    datasets: Sequence[Dataset], choice_dataset: Dataset, stop_on_empty_dataset: bool = True
) -> Dataset:
    """Elements of ``datasets`` in the order ``choice_dataset`` (integers) names them."""
    return DirectedInterleaveDataset(choice_dataset, datasets, stop_on_empty_dataset)


def _probabilities(weights: Any, n: int) -> np.ndarray:
    w = np.asarray(weights.tolist() if isinstance(weights, torch.Tensor) else weights,
                   dtype=np.float64).reshape(-1)
    if w.shape != (n,):
        raise ValueError(
            f"sample_from_datasets: {len(w)} weights for {n} datasets; give one weight per dataset"
        )
    if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(
            f"sample_from_datasets: weights must be finite, >= 0 and not all 0, got {w.tolist()}"
        )
    return w / w.sum()


BLOCK = 256
"""Uniform draws per seeded block (a SeedSequence per draw would cost ~20 us each)."""


class SelectorDataset(Dataset):
    """Infinite input indices for ``sample_from_datasets``: draw ``i`` picks index ``k`` with
    probability ``p[k]`` (or from the ``i``-th vector of a weights dataset). The uniform
    variates come in blocks of :data:`BLOCK` seeded from (seed, epoch, block), so the state
    is the draw count and a restore regenerates one block."""

    def __init__(
        self, n: int, p: np.ndarray | None, weights: Dataset | None, seed: int | None,
        same_every_epoch: bool,
    ) -> None:
        self._inputs = () if weights is None else (weights,)
        self._n, self._p, self._seed = n, p, seed
        self._same = same_every_epoch

    def _cardinality(self) -> int:
        return INFINITE_CARDINALITY if not self._inputs else self._inputs[0].cardinality()

    def _spec(self) -> Any:
        from stratagem.data.spec import TensorSpec

        return TensorSpec((), "int64")

    def _random_order(self) -> bool:
        return self._seed is None

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        import dataclasses

        seeds = dataclasses.replace(ctx, epoch=()) if self._same else ctx
        child = self._inputs[0]._make_iterator(ctx.child(0)) if self._inputs else None
        return _SelectorIterator(self, seeds, child)


class _SelectorIterator(StatefulIterator):
    def __init__(self, ds: SelectorDataset, seeds: Context, child: StatefulIterator | None
                 ) -> None:
        self.ds, self.seeds, self.child = ds, seeds, child
        self.children = [] if child is None else [child]
        self.count = 0
        self.block = -1
        self.uniforms = np.zeros(0)
        self.cdf = None if ds._p is None else np.cumsum(ds._p)

    def __next__(self) -> int:
        cdf = self.cdf
        if self.child is not None:
            cdf = np.cumsum(_probabilities(next(self.child), self.ds._n))
        block, offset = divmod(self.count, BLOCK)
        if block != self.block:
            rng = np.random.Generator(np.random.PCG64(
                self.seeds.seed_sequence(self.ds._seed, block)))
            self.uniforms, self.block = rng.random(BLOCK), block
        self.count += 1
        assert cdf is not None
        u = self.uniforms[offset] * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), self.ds._n - 1))

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count,
                "input": None if self.child is None else self.child.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        if self.child is not None:
            self.child.load_state_dict(state["input"])


def sample_from_datasets(
    datasets: Sequence[Dataset],
    weights: Any = None,
    seed: int | None = None,
    stop_on_empty_dataset: bool = False,
    rerandomize_each_iteration: bool | None = None,
) -> Dataset:
    """Each element from ``datasets[i]`` with probability ``weights[i]`` (uniform by default;
    ``weights`` may be a Dataset of weight vectors, one per draw). Exhausted inputs are
    skipped (their weight shared by the rest) unless ``stop_on_empty_dataset``.

    Draws are seeded from (seed, epoch, draw index): a new epoch draws anew unless
    ``rerandomize_each_iteration=False``.
    """
    datasets = list(datasets)
    if not datasets:
        raise ValueError("sample_from_datasets: datasets must not be empty")
    n = len(datasets)
    same = rerandomize_each_iteration is False
    selector: Dataset
    if isinstance(weights, Dataset):
        selector = SelectorDataset(n, None, weights, seed, same)
    else:
        p = _probabilities(np.ones(n) if weights is None else weights, n)
        if weights is not None:  # as tf.data: zero-weight inputs are dropped
            datasets = [d for d, w in zip(datasets, p) if w > 0]
            p = p[p > 0]
            n = len(datasets)
        if n == 1:
            return datasets[0]
        selector = SelectorDataset(n, p, None, seed, same)
    out = DirectedInterleaveDataset(selector, datasets, stop_on_empty_dataset)
    out._unseeded = seed is None
    return out


class _RandomlyFiltered(Dataset):
    """Marks an unseeded random filter (for DATA auto-sharding's order check)."""

    def __init__(self, input_ds: Dataset) -> None:
        self._inputs = (input_ds,)

    def _random_order(self) -> bool:
        return True

    def _make_iterator(self, ctx: Context) -> StatefulIterator:
        return self._inputs[0]._make_iterator(ctx.child(0))


# -- rejection_resample ------------------------------------------------------------------

def acceptance_probs(initial: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
    """tf.data's acceptance probabilities with mixing: ``(a, m)`` where ``m`` is the
    probability of taking the original stream and ``a[c]`` of accepting class ``c`` from the
    filtered one."""
    ratio = target / (initial + np.finfo(np.float64).tiny)
    hi, lo = float(ratio.max()), float(ratio.min())
    a = (ratio - lo) / (hi - lo) if hi > lo else np.zeros_like(ratio)
    return a, lo


class _ClassOf:
    def __init__(self, class_func: Callable[..., Any]) -> None:
        self.class_func = class_func

    def __call__(self, *x: Any) -> Any:
        return self.class_func(*x)


class _WithClass:
    def __init__(self, class_func: Callable[..., Any]) -> None:
        self.class_func = class_func

    def __call__(self, *x: Any) -> Any:
        return (self.class_func(*x), x[0] if len(x) == 1 else x)


def _class_index(c: Any, k: int) -> int:
    c = int(c.item() if isinstance(c, torch.Tensor | np.ndarray | np.generic) else c)
    if not 0 <= c < k:
        raise ValueError(f"rejection_resample: class_func returned {c}, outside [0, {k})")
    return c


class _Estimate:
    """scan step: per batch of 32 class values, update the counts and repeat the estimate."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, counts: Any, classes: Any) -> Any:
        seen = [_class_index(c, self.k) for c in torch.as_tensor(classes).reshape(-1).tolist()]
        new = torch.as_tensor(counts) + torch.bincount(torch.tensor(seen), minlength=self.k)
        dist = (new.double() / new.sum()).float()
        return new, dist.expand(len(seen), self.k).clone()


class _Accept:
    """(acceptance vector, element) -> (class, accepted?, element) with a seeded draw."""

    def __init__(self, class_func: Callable[..., Any], k: int) -> None:
        self.class_func, self.k = class_func, k

    def __call__(self, probs: Any, data: Any, rng: np.random.Generator) -> Any:
        c = self.class_func(*data) if isinstance(data, tuple) else self.class_func(data)
        p = float(np.asarray(probs)[_class_index(c, self.k)])
        return c, bool(rng.random() < p), data


def rejection_resample(
    dataset: Dataset,
    class_func: Callable[..., Any],
    target_dist: Any,
    initial_dist: Any = None,
    seed: int | None = None,
) -> Dataset:
    """tf.data's rejection_resample: (class, element) pairs whose class distribution tends
    to ``target_dist``. Without ``initial_dist`` the input's distribution is estimated online
    (counts from 10 per class, updated every 32 elements), exactly as tf.data builds it; the
    input is iterated by more than one branch, so it must give the same order each time (seed
    any shuffle upstream)."""
    from stratagem.data.sources import TensorsDataset

    target = np.asarray(target_dist, dtype=np.float64).reshape(-1)
    k = len(target)
    if k == 0 or (target < 0).any() or abs(target.sum() - 1) > 1e-5:
        raise ValueError(
            f"rejection_resample: target_dist must be a probability vector, got {target.tolist()}"
        )
    static_original: float | None = None
    if initial_dist is not None:
        initial = np.asarray(initial_dist, dtype=np.float64).reshape(-1)
        if initial.shape != target.shape:
            raise ValueError(
                f"rejection_resample: initial_dist has {len(initial)} classes, target_dist {k}"
            )
        accept, m = acceptance_probs(initial, target)
        accept_ds: Dataset = TensorsDataset(torch.tensor(accept)).repeat()
        original_ds: Dataset = TensorsDataset(m).repeat()
        static_original = float(np.min(target / initial))
    else:
        counts = torch.full((k,), 10, dtype=torch.int64)
        estimate = (
            dataset.map(_ClassOf(class_func)).batch(32).scan(counts, _Estimate(k)).unbatch()
        )
        pairs = estimate.map(lambda d: acceptance_probs(d.double().numpy(), target))
        accept_ds = pairs.map(lambda a, m: torch.as_tensor(a))
        original_ds = pairs.map(lambda a, m: m)
    from stratagem.data.transforms import MapDataset, ZipDataset

    filtered = (
        MapDataset(ZipDataset((accept_ds, dataset)), _Accept(class_func, k), with_rng=True,
                   seed=_subseed(seed, 1))
        .filter(lambda c, keep, data: keep)
        .map(lambda c, keep, data: (c, data))
    )
    original = dataset.map(_WithClass(class_func))
    if static_original is not None and static_original == 1:
        return original
    if static_original is not None and static_original == 0:
        return _RandomlyFiltered(filtered) if seed is None else filtered
    weights = original_ds.map(lambda m: (float(m), 1.0 - float(m)))
    return sample_from_datasets(
        [original, filtered], weights=weights, seed=_subseed(seed, 2), stop_on_empty_dataset=True
    )


def _subseed(seed: int | None, stream: int) -> int | None:
    """A seed for one of several random streams built from one user seed."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([int(seed) & (2**64 - 1), stream]).generate_state(1)[0])
