"""Keras's optimizers and learning-rate schedules for torch modules.

A Keras optimizer is made before the model's weights exist (``keras.optimizers.Adam(
learning_rate=1e-3)``, or the name ``"adam"`` given to ``compile``); a torch optimizer needs the
parameters. So ``stratagem.optimizers.Adam(...)`` is a recipe: ``build(params)`` makes the torch
optimizer (``Model.compile`` calls it), with Keras's defaults and Keras's update rules:

- ``SGD`` and ``RMSprop`` follow Keras's formulas exactly (Keras's momentum accumulates
  ``lr * grad``; Keras's RMSprop adds epsilon under the square root, with ``rho=0.9``), which
  torch's ``SGD``/``RMSprop`` do not (``RMSprop`` there adds epsilon after the root, ``alpha=0.99``).
- ``Adam``, ``AdamW`` and ``Adagrad`` are torch's classes with Keras's defaults
  (``epsilon=1e-7``; AdamW's ``weight_decay=0.004``; Adagrad's ``initial_accumulator_value=0.1``).
  Keras adds Adam's epsilon to ``sqrt(v)`` before the bias correction and torch after it, so
  before each update torch's ``eps`` is set to ``epsilon / sqrt(1 - beta_2 ** t)``: the same
  update as Keras's (with torch's ``eps=1e-7`` the first updates of small gradients would differ by
  up to ~1e-4 relative). Adagrad's epsilon enters as in Keras up to ``sqrt(acc + eps)`` against
  ``sqrt(acc) + eps``, below float tolerance with the accumulator starting at 0.1.

``learning_rate`` may be a number or a ``LearningRateSchedule`` (``ExponentialDecay``,
``PiecewiseConstantDecay``, ``InverseTimeDecay``, ``PolynomialDecay``, ``CosineDecay``): as in Keras
it is evaluated at ``optimizer.iterations`` (the number of updates applied so far, 0 at the first)
before every update, so it changes per batch, not per epoch. ``iterations`` is saved in the
optimizer's ``state_dict`` (its first parameter group), so a resumed run goes on with the same
rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from stratagem.core.eager import eager_only

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "CosineDecay",
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "Optimizer",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "RMSprop",
    "get",
    "schedules",
]


# --- learning-rate schedules ------------------------------------------------------------------
class LearningRateSchedule:
    """Keras's ``LearningRateSchedule``: ``schedule(step) -> learning rate`` (step = updates so far)."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        """Keras's ``get_config``: ``type(self)(**config)`` makes the same schedule."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (integer division with
    ``staircase=True``)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float,
                 staircase: bool = False, name: str = "ExponentialDecay") -> None:
        if decay_steps <= 0:
            raise ValueError(f"ExponentialDecay: decay_steps must be > 0, got {decay_steps}")
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_steps = decay_steps
        self.decay_rate = float(decay_rate)
        self.staircase = staircase
        self.name = name

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate * self.decay_rate**p


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` while ``step <= boundaries[0]``, ``values[1]`` while ``step <= boundaries[1]``,
    ..., ``values[-1]`` after the last boundary (Keras's rule)."""

    def __init__(self, boundaries: Sequence[int], values: Sequence[float], name: str = "PiecewiseConstant") -> None:
        if len(values) != len(boundaries) + 1:
            raise ValueError(
                f"PiecewiseConstantDecay: values must have one more element than boundaries; got "
                f"{len(boundaries)} boundaries and {len(values)} values"
            )
        self.boundaries = list(boundaries)
        self.values = [float(v) for v in values]
        self.name = name

    def __call__(self, step: int) -> float:
        for boundary, value in zip(self.boundaries, self.values):
            if step <= boundary:
                return value
        return self.values[-1]


class InverseTimeDecay(LearningRateSchedule):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (floored with staircase)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float,
                 staircase: bool = False, name: str = "InverseTimeDecay") -> None:
        if decay_steps <= 0:
            raise ValueError(f"InverseTimeDecay: decay_steps must be > 0, got {decay_steps}")
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_steps = decay_steps
        self.decay_rate = float(decay_rate)
        self.staircase = staircase
        self.name = name

    def __call__(self, step: int) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate / (1 + self.decay_rate * p)


class PolynomialDecay(LearningRateSchedule):
    """From ``initial_learning_rate`` to ``end_learning_rate`` over ``decay_steps`` as
    ``(1 - step / decay_steps) ** power`` (Keras's rule, ``cycle`` included)."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, end_learning_rate: float = 0.0001,
                 power: float = 1.0, cycle: bool = False, name: str = "PolynomialDecay") -> None:
        if decay_steps <= 0:
            raise ValueError(f"PolynomialDecay: decay_steps must be > 0, got {decay_steps}")
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_steps = decay_steps
        self.end_learning_rate = float(end_learning_rate)
        self.power = float(power)
        self.cycle = cycle
        self.name = name

    def __call__(self, step: int) -> float:
        decay_steps = float(self.decay_steps)
        s = float(step)
        if self.cycle:
            # Keras: decay_steps * ceil(step / decay_steps), with step 0 counted as one period
            decay_steps *= max(1.0, math.ceil(s / decay_steps))
        else:
            s = min(s, decay_steps)
        frac = 1 - s / decay_steps
        return (self.initial_learning_rate - self.end_learning_rate) * frac**self.power + self.end_learning_rate


class CosineDecay(LearningRateSchedule):
    """Keras's cosine decay with optional linear warm-up: from ``initial_learning_rate`` up to
    ``warmup_target`` over ``warmup_steps``, then a cosine from there down to ``alpha`` times it
    over ``decay_steps``."""

    def __init__(self, initial_learning_rate: float, decay_steps: int, alpha: float = 0.0,
                 name: str = "CosineDecay", warmup_target: float | None = None, warmup_steps: int = 0) -> None:
        if decay_steps <= 0:
            raise ValueError(f"CosineDecay: decay_steps must be > 0, got {decay_steps}")
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_steps = decay_steps
        self.alpha = float(alpha)
        self.name = name
        self.warmup_target = None if warmup_target is None else float(warmup_target)
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        if self.warmup_target is None:
            target = self.initial_learning_rate
        else:
            target = self.warmup_target
            if step < self.warmup_steps:
                done = step / self.warmup_steps
                return self.initial_learning_rate + (target - self.initial_learning_rate) * done
        frac = min(max((step - self.warmup_steps) / self.decay_steps, 0.0), 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * frac))
        return target * ((1 - self.alpha) * cosine + self.alpha)


class _Schedules:
    """``stratagem.optimizers.schedules``: Keras's ``keras.optimizers.schedules`` names."""

    LearningRateSchedule = LearningRateSchedule
    ExponentialDecay = ExponentialDecay
    PiecewiseConstantDecay = PiecewiseConstantDecay
    InverseTimeDecay = InverseTimeDecay
    PolynomialDecay = PolynomialDecay
    CosineDecay = CosineDecay


schedules = _Schedules()

LearningRate = float | LearningRateSchedule | Callable[[int], float]


# --- the torch optimizers: a Keras schedule stepped per update ------------------------------
class _KerasSteps:
    """Mixed into a torch optimizer: Keras's ``iterations`` and per-update learning rate.

    ``iterations`` lives in the first parameter group (saved with ``state_dict``)."""

    param_groups: list[dict[str, Any]]
    _schedule: Callable[[int], float] | None
    #: Adam's epsilon as Keras applies it (None: the optimizer's own eps)
    _keras_epsilon: float | None = None

    @property
    def iterations(self) -> int:
        return int(self.param_groups[0].get("iterations", 0))

    @property
    def learning_rate(self) -> float:
        """The rate the next update uses (Keras's ``optimizer.learning_rate``); assign a number to
        change it (Keras's ``optimizer.learning_rate = 0.01``, as a callback's scheduler does)."""
        if self._schedule is not None:
            return float(self._schedule(self.iterations))
        return float(self.param_groups[0]["lr"])

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        if self._schedule is not None:
            raise TypeError(
                "This optimizer was created with a `LearningRateSchedule` object as its `learning_rate` "
                "constructor argument, hence its learning rate is not settable. If you need the learning "
                "rate to be settable, you should instantiate the optimizer with a float `learning_rate` argument."
            )
        lr = float(value)
        if lr < 0:
            raise ValueError(f"learning_rate must be >= 0, got {value!r}")
        for group in self.param_groups:
            group["lr"] = lr

    def _before_step(self) -> None:
        if self._schedule is not None:
            lr = float(self._schedule(self.iterations))
            for group in self.param_groups:
                group["lr"] = lr
        if self._keras_epsilon is not None:
            # Keras adds Adam's epsilon to sqrt(v) before the bias correction, torch after it: the
            # same update when torch's eps is Keras's over sqrt(1 - beta_2 ** t)
            t = self.iterations + 1
            for group in self.param_groups:
                group["eps"] = self._keras_epsilon / math.sqrt(1.0 - group["betas"][1] ** t)

    def _after_step(self) -> None:
        self.param_groups[0]["iterations"] = self.iterations + 1

    def apply(self, grads: Iterable[Any], trainable_variables: Iterable[Any] | None = None) -> None:
        """Keras's ``optimizer.apply(grads, trainable_variables)``: one update of those variables
        (``Model.trainable_weights``' ``Variable`` objects or the tensors; all the optimizer holds
        when None) with ``grads``, the others left as they are."""
        apply_update(self, grads, trainable_variables)  # type: ignore[arg-type]

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> None:
        """Keras's ``optimizer.apply_gradients(zip(grads, variables))``."""
        pairs = list(grads_and_vars)
        self.apply([g for g, _ in pairs], [v for _, v in pairs])


def apply_update(optimizer: torch.optim.Optimizer, grads: Iterable[Any], variables: Iterable[Any] | None) -> None:
    """One ``optimizer.step()`` that updates only ``variables``, with ``grads`` as their gradients."""
    from stratagem.train.variables import tensor_of

    held = [p for g in optimizer.param_groups for p in g["params"]]
    targets = held if variables is None else [tensor_of(v) for v in variables]
    grads = list(grads)
    if len(grads) != len(targets):
        raise ValueError(f"apply: got {len(grads)} gradients for {len(targets)} variables; give one gradient per variable")
    ids = {id(p) for p in held}
    foreign = [tuple(t.shape) for t in targets if id(t) not in ids]
    if foreign:
        raise ValueError(
            f"apply: {len(foreign)} of the variables (shapes {foreign[:3]}) are not held by this optimizer, which "
            f"was built over {len(held)} others; build one optimizer per set of weights (as a GAN's d_optimizer "
            "and g_optimizer)"
        )
    chosen = {id(t) for t in targets}
    kept = {i: p.grad for i, p in enumerate(held) if id(p) not in chosen and p.grad is not None}
    for i in kept:
        held[i].grad = None
    for t, g in zip(targets, grads):
        if g is not t.grad:
            t.grad = None if g is None else g.to(t.dtype) if g.dtype != t.dtype else g
    try:
        optimizer.step()
    finally:
        for i, g in kept.items():
            held[i].grad = g


_SCHEDULED: dict[type, Any] = {}


def _scheduled(cls: type[torch.optim.Optimizer]) -> Any:
    """``cls`` with Keras's per-update schedule and ``iterations`` (one class per ``cls``)."""
    if cls in _SCHEDULED:
        return _SCHEDULED[cls]

    class Scheduled(_KerasSteps, cls):  # type: ignore[valid-type,misc]
        def __init__(self, params: Any, schedule: Callable[[int], float] | None, **kwargs: Any) -> None:
            super().__init__(params, **kwargs)
            self._schedule = schedule
            self.param_groups[0].setdefault("iterations", 0)

        def step(self, closure: Any = None) -> Any:
            self._before_step()
            out = super().step(closure)
            self._after_step()
            return out

    Scheduled.__name__ = Scheduled.__qualname__ = f"Keras{cls.__name__}"
    # inside a compiled step the update runs eagerly: the learning rate, Adam's epsilon and
    # ``iterations`` change every update, and a traced step would be specialised on each value
    # (a recompilation per update, until dynamo gives up on the frame)
    eager_only(Scheduled, ["step"])
    _SCHEDULED[cls] = Scheduled
    return Scheduled


class _KerasSGD(torch.optim.Optimizer):
    """Keras's SGD: ``m = momentum * m - lr * g; w += m`` (nesterov: ``w += momentum * m - lr * g``)."""

    def __init__(self, params: Any, lr: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if wd:  # Keras 3 applies weight_decay as decoupled decay before the update
                    p.mul_(1 - lr * wd)
                if mom:
                    state = self.state[p]
                    m = state.get("momentum")
                    if m is None:
                        m = state["momentum"] = torch.zeros_like(p)
                    m.mul_(mom).add_(g, alpha=-lr)
                    if group["nesterov"]:
                        p.add_(m, alpha=mom).add_(g, alpha=-lr)
                    else:
                        p.add_(m)
                else:
                    p.add_(g, alpha=-lr)
        return loss


class _KerasRMSprop(torch.optim.Optimizer):
    """Keras's RMSprop: ``v = rho * v + (1 - rho) * g**2``; ``w -= lr * g / sqrt(v + epsilon)``
    (centered: ``v - mean_g**2 + epsilon``), with momentum on the increment."""

    def __init__(self, params: Any, lr: float = 0.001, rho: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-7, centered: bool = False, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "rho": rho, "momentum": momentum, "epsilon": epsilon,
                                  "centered": centered, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, rho, mom, eps = group["lr"], group["rho"], group["momentum"], group["epsilon"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                state = self.state[p]
                if "velocity" not in state:
                    state["velocity"] = torch.zeros_like(p)
                    if group["centered"]:
                        state["average_gradient"] = torch.zeros_like(p)
                    if mom:
                        state["momentum"] = torch.zeros_like(p)
                v = state["velocity"]
                v.mul_(rho).addcmul_(g, g, value=1 - rho)
                if group["centered"]:
                    avg = state["average_gradient"]
                    avg.mul_(rho).add_(g, alpha=1 - rho)
                    denom = v - avg * avg + eps
                else:
                    denom = v + eps
                increment = g.mul(lr).div_(denom.sqrt_())
                if mom:
                    m = state["momentum"]
                    m.mul_(mom).add_(increment)
                    p.sub_(m)
                else:
                    p.sub_(increment)
        return loss


# --- the recipes users name ------------------------------------------------------------------
class _Holder:
    """Tensors seen as an optimizer would hold them (to ask which strategy made them)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


class Optimizer:
    """A Keras optimizer before the model exists: ``build(params)`` makes the torch optimizer."""

    torch_class: Any
    defaults: dict[str, Any] = {}
    #: Keras's argument name -> torch's
    renames: dict[str, str] = {}

    def __init__(self, learning_rate: LearningRate = 0.001, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(self.defaults))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: unexpected argument(s) {unknown}; it takes learning_rate and "
                f"{sorted(self.defaults)}"
            )
        if isinstance(learning_rate, (int, float)) and learning_rate < 0:
            raise ValueError(f"{type(self).__name__}: learning_rate must be >= 0, got {learning_rate}")
        self.learning_rate = learning_rate
        self.config = {**self.defaults, **kwargs}

    def build(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The torch optimizer over ``params`` (a module's ``parameters()``)."""
        lr = self.learning_rate
        schedule = None if isinstance(lr, (int, float)) else lr
        start = float(lr) if schedule is None else float(schedule(0))  # type: ignore[arg-type]
        kwargs = {self.renames.get(k, k): v for k, v in self.config.items()}
        cls = _scheduled(self.torch_class)
        return cls(params, schedule, lr=start, **kwargs)  # type: ignore[no-any-return]

    def apply(self, grads: Iterable[Any], trainable_variables: Iterable[Any]) -> None:
        """Keras's ``optimizer.apply(grads, trainable_variables)`` on a recipe that was never
        given to ``compile`` (a GAN's ``d_optimizer``): built over those variables at the first
        call, as Keras builds its optimizer's variables, then applied; later calls update them."""
        from stratagem.train.variables import tensor_of

        variables = list(trainable_variables)
        built = self.__dict__.get("_built")
        if built is None:
            params = [tensor_of(v) for v in variables]
            from stratagem.distribute.ownership import strategy_of

            strategy = strategy_of(_Holder(params))
            with strategy.scope() if strategy is not None else _nothing():
                built = self.build(params)
            self.__dict__["_built"] = built
        apply_update(built, grads, variables)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> None:
        """Keras's ``optimizer.apply_gradients(zip(grads, variables))``."""
        pairs = list(grads_and_vars)
        self.apply([g for g, _ in pairs], [v for _, v in pairs])

    @property
    def iterations(self) -> int:
        """Updates applied by ``apply`` so far (0 before the first)."""
        built = self.__dict__.get("_built")
        return 0 if built is None else int(built.iterations)

    def state_dict(self) -> dict[str, Any]:
        """The built optimizer's state (after the first ``apply``), for a checkpoint."""
        built = self.__dict__.get("_built")
        if built is None:
            raise ValueError(f"{type(self).__name__} has no state yet: it is built by its first apply()")
        return built.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        built = self.__dict__.get("_built")
        if built is None:
            raise ValueError(f"{type(self).__name__} is built by its first apply(); restore it after that")
        built.load_state_dict(state)

    def get_config(self) -> dict[str, Any]:
        """Keras's ``get_config``: ``type(self)(**config)`` makes the same recipe."""
        return {"learning_rate": self.learning_rate, **self.config}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(learning_rate={self.learning_rate!r}, " + ", ".join(
            f"{k}={v!r}" for k, v in self.config.items()
        ) + ")"


class SGD(Optimizer):
    """Keras's ``SGD(learning_rate=0.01, momentum=0.0, nesterov=False)``."""

    torch_class = _KerasSGD
    defaults = {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0}

    def __init__(self, learning_rate: LearningRate = 0.01, **kwargs: Any) -> None:
        super().__init__(learning_rate, **kwargs)


class RMSprop(Optimizer):
    """Keras's ``RMSprop(learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False)``."""

    torch_class = _KerasRMSprop
    defaults = {"rho": 0.9, "momentum": 0.0, "epsilon": 1e-7, "centered": False, "weight_decay": 0.0}


class Adam(Optimizer):
    """Keras's ``Adam(learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False)``
    (torch's Adam)."""

    torch_class: Any = torch.optim.Adam
    defaults = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False}

    def build(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        c = dict(self.config)
        betas = (c.pop("beta_1"), c.pop("beta_2"))
        lr = self.learning_rate
        schedule = None if isinstance(lr, (int, float)) else lr
        start = float(lr) if schedule is None else float(schedule(0))  # type: ignore[arg-type]
        extra = {"weight_decay": c.pop("weight_decay")} if "weight_decay" in c else {}
        cls = _scheduled(self.torch_class)
        epsilon = float(c.pop("epsilon"))
        opt = cls(params, schedule, lr=start, betas=betas, eps=epsilon, amsgrad=c.pop("amsgrad"), **extra)
        opt._keras_epsilon = epsilon
        return opt  # type: ignore[no-any-return]


class AdamW(Adam):
    """Keras's ``AdamW(learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999,
    epsilon=1e-7)`` (torch's AdamW: the same decoupled decay, ``w -= lr * weight_decay * w``)."""

    torch_class = torch.optim.AdamW
    defaults = {"weight_decay": 0.004, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False}


class Adagrad(Optimizer):
    """Keras's ``Adagrad(learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7)``
    (torch's Adagrad)."""

    torch_class = torch.optim.Adagrad
    defaults = {"initial_accumulator_value": 0.1, "epsilon": 1e-7}
    renames = {"epsilon": "eps"}


_BY_NAME: dict[str, type[Optimizer]] = {
    "sgd": SGD, "rmsprop": RMSprop, "adam": Adam, "adamw": AdamW, "adagrad": Adagrad,
}
#: Keras optimizer names stratagem does not offer (their torch equivalents' update rules differ)
_NOT_OFFERED = ("adadelta", "adafactor", "adamax", "ftrl", "lamb", "lion", "loss_scale_optimizer", "nadam")


def get(identifier: str | Optimizer | torch.optim.Optimizer, params: Iterable[Any]) -> torch.optim.Optimizer:
    """The torch optimizer for a Keras name (``"adam"``), a recipe (``Adam(...)``) or a torch
    optimizer (returned as is: it already holds its parameters)."""
    if isinstance(identifier, torch.optim.Optimizer):
        return identifier
    if isinstance(identifier, Optimizer):
        return identifier.build(params)
    if isinstance(identifier, str):
        name = identifier.lower()
        if name in _BY_NAME:
            return _BY_NAME[name]().build(params)
        more = f" ({identifier!r} is a Keras optimizer stratagem does not offer: pass a torch optimizer)" if (
            name in _NOT_OFFERED) else ""
        raise ValueError(
            f"unknown optimizer {identifier!r}{more}; use one of {sorted(_BY_NAME)}, a "
            "stratagem.optimizers recipe (stratagem.optimizers.Adam(learning_rate=...)) or a "
            "torch.optim optimizer made over model.parameters()"
        )
    raise TypeError(
        f"optimizer must be a name ({sorted(_BY_NAME)}), a stratagem.optimizers recipe or a "
        f"torch.optim.Optimizer; got {type(identifier).__name__}"
    )
