"""fit's synchronous epochs (every strategy whose replicas step together): executions of up to
``steps_per_execution`` steps, each ended by one sync of the logs, then validation, the callbacks
and the stop agreed by every replica; and the test pass that validation and ``evaluate`` run.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from stratagem.comm.errors import CollectiveError
from stratagem.distribute import context
from stratagem.distribute.strategy import Strategy
from stratagem.train.callback import Callback, CallbackList, FitState, Logs
from stratagem.train.failover import FitFailover
from stratagem.train.history import History, log_value
from stratagem.train.inputs import GlobalBatches, distributed
from stratagem.train.metrics import Metric, sync_metrics
from stratagem.train.progress import Progress, resolve_mode
from stratagem.train.resume import FitProgress

_T = TypeVar("_T")

#: ``steps_per_execution="auto"``: the most steps between two reads of the logs, and the share of
#: the step time that an execution's fixed cost (``strategy.run``, the metric updates, the sync
#: and read-back of the logs) may add.
AUTO_MAX_STEPS_PER_EXECUTION = 128
AUTO_SYNC_SHARE = 0.01


_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


def _acts_per_batch(cb: Callback) -> bool:
    if isinstance(cb, Progress):
        return False  # the progress bar is fine with a log per execution
    kind = type(cb)  # a hook set on the instance (LambdaCallback) counts too
    return any(getattr(kind, hook) is not getattr(Callback, hook) or hook in getattr(cb, "__dict__", {}) for hook in _BATCH_HOOKS)


def _may_stop_per_batch(cb: Callback) -> bool:
    """Whether ``cb``'s batch hooks may set ``stop_training`` (fit then agrees after each batch)."""
    return _acts_per_batch(cb) and bool(getattr(cb, "may_stop_per_batch", True))


def _agreed_callback_facts(steps: Any, callbacks: Sequence[Callback]) -> tuple[bool, bool, bool]:
    """Whether any replica's callbacks act per batch, may stop per batch, may stop at an epoch's
    end: agreed across the job (``steps.agree``, once a fit), since each changes the collectives
    fit makes. A logger or TensorBoard given to the chief only must not leave the others waiting
    in another collective."""
    return (steps.agree(any(_acts_per_batch(cb) for cb in callbacks)),
            steps.agree(any(_may_stop_per_batch(cb) for cb in callbacks)),
            steps.agree(any(not isinstance(cb, Progress) for cb in callbacks)))  # fmt: skip


def _stop_asked(state: FitState) -> bool:
    """Whether this replica's callbacks asked to stop: ``state.stop_training`` or Keras's
    ``self.model.stop_training``."""
    return bool(state.stop_training) or bool(getattr(state.model, "stop_training", False))


def _set_model_flag(model: Any, value: bool) -> None:
    """Keras's ``model.stop_training`` (False when fit starts, True once it stopped early)."""
    try:
        model.stop_training = value
    except (AttributeError, TypeError):  # an object that takes no attributes: state.stop_training only
        pass


class _Cadence:
    """How many steps each execution runs. A number is used as given; ``"auto"`` is 1 while a
    callback acts per batch, else measured: the first two executions run one step each, timing
    the step (inside ``strategy.run``) and the execution's fixed cost around it; at the second
    sync every replica proposes the smallest count that keeps the fixed cost under
    ``AUTO_SYNC_SHARE`` of the steps' time (at most ``AUTO_MAX_STEPS_PER_EXECUTION``), and all
    use the mean of the proposals (summed in the sync they already do, so they agree). So a
    step of a few milliseconds or more keeps a log per step, as in Keras."""

    def __init__(self, value: int | str, callbacks: Sequence[Callback], acts_per_batch: bool | None = None) -> None:
        if value == "auto":
            self.size = 1
            acts = any(_acts_per_batch(cb) for cb in callbacks) if acts_per_batch is None else acts_per_batch
            self.measuring = not acts
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"steps_per_execution must be a positive number of steps or 'auto', got {value!r}")
        else:
            self.size, self.measuring = value, False
        self.step_times: list[float] = []  # seconds per step
        self.fixed_times: list[float] = []  # seconds of an execution outside its steps

    def timed(self, steps: int, seconds: float, in_steps: float | None, sync: float) -> None:
        """One execution of ``steps`` steps took ``seconds`` to train (``in_steps`` of them in the
        steps themselves, when known) and ``sync`` to sync."""
        inner = seconds if in_steps is None else min(in_steps, seconds)
        self.step_times.append(inner / steps)
        self.fixed_times.append(seconds - inner + sync)

    def proposal(self, seconds: float, in_steps: float | None, steps: int) -> list[float]:
        """What this replica adds to the sync of an execution that trained ``steps`` steps in
        ``seconds`` (``in_steps`` in the steps): nothing, or its proposed count."""
        if not self.measuring or not self.fixed_times:
            return []
        inner = seconds if in_steps is None else min(in_steps, seconds)
        step = min(*self.step_times, inner / steps)
        fixed = min(self.fixed_times)
        want = math.ceil(fixed / max(AUTO_SYNC_SHARE * step, 1e-9))
        return [float(min(max(want, 1), AUTO_MAX_STEPS_PER_EXECUTION))]

    def agreed(self, total: list[float], replicas: int) -> None:
        if total:
            self.size = max(1, min(AUTO_MAX_STEPS_PER_EXECUTION, math.ceil(total[0] / replicas - 1e-9)))
            self.measuring = False


def _end_execution(
    strategy: Strategy, tracked: Sequence[Metric], state: FitState, cblist: CallbackList, extra: list[float],
    summed: list[float] | None = None,
) -> list[float]:
    """The end of an execution: one collective for every total (none when the step's commit
    summed them already: ``summed``), then the batch-end logs."""
    if summed is None:
        summed = sync_metrics(strategy, tracked, extra)
    state.samples = int(tracked[0].global_totals()[1])
    cblist.call("on_train_batch_end", state.step - 1, _logs(tracked))
    return summed


def _batches(strategy: Strategy, data: Iterable[Any], steps: int | None) -> Iterable[Any]:
    batches = distributed(strategy, data)
    return batches if steps is None else itertools.islice(batches, steps)


def _logs(metrics: Sequence[Metric], prefix: str = "") -> Logs:
    logs: Logs = {}
    for m in metrics:
        value = m.result()
        if isinstance(value, Mapping):  # a metric whose result is a dict logs each entry (Keras)
            logs.update({prefix + str(k): log_value(v) for k, v in value.items()})
        else:
            logs[prefix + m.name] = log_value(value)
    return dict(sorted(logs.items()))  # Keras 3's logs come in sorted order (its history, its bar)


def _reset(metrics: Sequence[Metric]) -> None:
    for m in metrics:
        m.reset_state()


def _run_test(
    strategy: Strategy,
    runner: Any,
    data: Iterable[Any],
    tracked: Sequence[Metric],
    cblist: CallbackList | None,
    steps: int | None = None,
    what: str = "evaluate's data",
) -> Logs:
    _reset(tracked)
    if cblist is not None:
        cblist.call("on_test_begin", None)
    logs: Logs = {}
    read = 0
    for i, batch in enumerate(_batches(strategy, data, steps)):
        read += 1
        if cblist is not None:
            cblist.call("on_test_batch_begin", i, None)
        runner.test(batch, tracked[0], tracked[1:])
        if cblist is not None:
            sync_metrics(strategy, tracked)
            cblist.call("on_test_batch_end", i, _logs(tracked))
    if read == 0 and steps != 0:  # every replica: each reads the same global batches
        raise ValueError(
            f"{what} gave no batch: the data is empty, so there is no loss or metric to report (Keras "
            "raises here too); check the dataset's length, a filter that drops everything, or "
            "drop_remainder=True on fewer examples than one global batch"
        )
    sync_metrics(strategy, tracked)
    logs = _logs(tracked)
    if cblist is not None:
        cblist.call("on_test_end", logs)
    return logs


class _Loop:
    """fit's epochs when the replicas step together (every strategy but ParameterServerStrategy):
    executions of up to ``steps_per_execution`` steps, each ended by one sync of the logs, then
    validation, the callbacks and the stop agreed by every replica."""

    def __init__(
        self,
        strategy: Strategy,
        steps: Any,
        optimizer: torch.optim.Optimizer,
        batches: GlobalBatches,
        tracked: list[Metric],
        val_tracked: list[Metric],
        params: dict[str, Any],
        callbacks: Sequence[Callback],
        verbose: int | str,
        steps_per_execution: int | str,
        accumulate: int,
    ) -> None:
        self.strategy, self.steps, self.batches = strategy, steps, batches
        self.tracked, self.val_tracked = tracked, val_tracked
        self.accumulate = accumulate
        self.validation: tuple[Iterable[Any], int | None] | None = None
        self.epoch_scheduler: Any = None
        self.history = History(params)
        self.state = state = FitState(steps.module, optimizer, strategy, self.history, params, is_chief=steps.is_chief)
        cbs = list(callbacks)
        mode = resolve_mode(verbose)
        if mode is not None and not any(isinstance(cb, Progress) for cb in cbs):
            cbs.insert(0, Progress(mode))
        self.cblist = CallbackList(cbs, state)
        self._steps_per_execution = steps_per_execution
        # what the callbacks ask of the loop (a hook per batch, a stop per batch or epoch), agreed
        # across the job at the first epoch (``_agree_callbacks``): these are this process's own
        self.cadence = _Cadence(steps_per_execution, cbs)
        self.per_batch_stop = any(_may_stop_per_batch(cb) for cb in cbs)
        # only a callback of the user's may ask to stop at an epoch's end (the progress bar
        # never does): without one there is nothing to agree on then
        self.epoch_stop = any(not isinstance(cb, Progress) for cb in cbs)
        self._agreed_facts: list[bool] | None = None  # (acts, batch_stop, epoch_stop), once agreed
        state.capture = self.capture
        state.restore = self.restore
        #: FailureOptions(on_failure="continue"): what to do after a lost replica (train/failover.py)
        self.failover: FitFailover | None = None
        self._entered = False  # this process came into a running job at this fit's start

    def continue_on_failure(self, failover: FitFailover) -> None:
        """Go on without a replica lost during training steps: each committed update recorded."""
        self.failover = failover
        state, batches, tracked = self.state, self.batches, self.tracked
        self.steps.on_commit = lambda: failover.record(
            state.epoch, batches.state_dict(), state.step + 1, state.iterations + 1, tracked, committing=True
        )
        # the step's sync rides on the commit: a stop asked before it, a lost replica back
        self.steps.commit_extra = lambda: [float(_stop_asked(state)), float(failover.joins_waiting())]
        failover.keep_agreed("callbacks", self._callback_facts, self._adopt_callback_facts)
        # the first global batch compared across replicas: once (a survivor whose comparison
        # finished must not wait in it again while another, whose comparison broke, makes it)
        whole = batches.dist
        failover.keep_agreed("first batch", lambda: True if whole._checked else None,
                             lambda _: setattr(whole, "_checked", True))  # fmt: skip

    def capture(self, progress: FitProgress, *, epoch_end: bool) -> None:
        state = self.state
        progress.capture(
            epoch=state.epoch + 1 if epoch_end else state.epoch,
            step=0 if epoch_end else state.step,
            iterations=state.iterations,
            data=self.batches.state_dict(),
            metrics=self.tracked,
            history=self.history.state_dict(),
            loss_scale=self.steps.loss_scale_state(),
        )

    def restore(self, progress: FitProgress) -> None:
        saved, state = progress.state, self.state
        self.batches.load_state_dict(saved["data"])
        self.history.load_state_dict(saved["history"])
        if saved["step"] > 0:
            progress.restore_metrics(self.tracked)
        state.initial_epoch, state.initial_step = int(saved["epoch"]), int(saved["step"])
        state.iterations = int(saved["iterations"])
        pieces = getattr(self.steps, "pieces", None)
        if pieces is not None:  # the deterministic mode's dropout: by update, as the run that went on
            pieces.updates = state.iterations
        if saved.get("loss_scale") is not None:
            self.steps.load_loss_scale_state(saved["loss_scale"])

    def run(self, initial_epoch: int, epochs: int) -> History:
        if self.failover is None:
            return self._run(initial_epoch, epochs)
        self.failover.open()
        try:
            return self._run(initial_epoch, epochs)
        finally:
            self.failover.close()

    def _run(self, initial_epoch: int, epochs: int) -> History:
        state, cblist = self.state, self.cblist
        logs: Logs = {}
        _set_model_flag(state.model, False)  # as Keras: model.stop_training is reset by each fit
        with context.strategy_scope(self.strategy):
            cblist.call("on_train_begin", None)
            if state.initial_epoch == 0 and state.initial_step == 0:
                state.initial_epoch = initial_epoch  # a backup restored by on_train_begin wins
            if self.failover is not None and self.failover.joining:
                self.failover.enter(self)  # a new process in a running job: where the others are
                self._entered = True
            for epoch in range(state.initial_epoch, epochs):
                logs = self._epoch(epoch)
                if self._going_on(lambda: self.steps.agree(_stop_asked(state)) if self.epoch_stop else _stop_asked(state)):
                    state.stop_training = True
                    _set_model_flag(state.model, True)
                    break
            cblist.call("on_train_end", dict(logs))
        return self.history

    def _agree_callbacks(self) -> None:
        """The callbacks' facts that change fit's collectives, the same on every replica (a
        callback given to one replica only would otherwise leave the others in other collectives)."""
        if self._agreed_facts is None:  # (else adopted from a survivor after a failure in it)
            self._adopt_callback_facts(list(_agreed_callback_facts(self.steps, self.cblist.callbacks)))

    def _callback_facts(self) -> list[bool] | None:
        return self._agreed_facts

    def _adopt_callback_facts(self, facts: list[bool]) -> None:
        acts, batch_stop, epoch_stop = (bool(f) for f in facts)
        self._agreed_facts = [acts, batch_stop, epoch_stop]
        self.cadence = _Cadence(self._steps_per_execution, self.cblist.callbacks, acts_per_batch=acts)
        self.per_batch_stop, self.epoch_stop = batch_stop, epoch_stop

    def _going_on(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` (a collective part of an epoch's end: validation, the stop vote), done again
        after a lost replica under ``on_failure="continue"`` (every update of the epoch is
        committed by then: the survivors line up, and ``fn`` starts over)."""
        while True:
            try:
                return fn()
            except CollectiveError as e:
                if self.failover is None:
                    raise
                self._recover(e, [])

    def _take(self, n: int) -> list[Any]:
        """The next execution's batches. The input's own collectives (its vote on the batches)
        go on without a lost replica too (``on_failure="continue"``): the iterator the failure
        broke is made again at the committed position."""
        while True:
            try:
                return self.batches.take(n)
            except CollectiveError as e:
                if self.failover is None:
                    raise
                self._recover(e, [])
                self.batches.load_state_dict(self.failover.committed.data)

    def _recover(self, error: CollectiveError, group: list[Any]) -> list[Any] | None:
        """After a lost replica: the survivors at the last committed update; returns the batches
        to train again (the interrupted update's, drawn already) or None (the data was moved)."""
        assert self.failover is not None
        committed = self.failover.recover(error, self.tracked)
        state, batches = self.state, self.batches
        state.step, state.iterations = committed.step, committed.iterations
        here = batches.state_dict()
        if here["pass"] == committed.data["pass"]:
            if here["consumed"] - len(group) == committed.data["consumed"]:
                return group  # the interrupted update: trained again on the same global batches
            if here["consumed"] == committed.data["consumed"]:
                return None  # committed already (the failure came after it)
        batches.load_state_dict(committed.data)  # replay the pass up to the committed position
        return None

    def _epoch(self, epoch: int) -> Logs:
        state, steps, tracked = self.state, self.steps, self.tracked
        state.epoch = epoch
        if epoch == state.initial_epoch and state.initial_step > 0:
            state.step = state.initial_step  # resumed mid-epoch: data, metrics already restored
        else:
            state.step = 0
            _reset(tracked)
            self.batches.begin_epoch()
        if self._entered:  # the totals came with the state from a live peer
            self._entered = False
        elif state.step > 0:  # resumed mid-epoch: the restored totals, summed
            sync_metrics(self.strategy, tracked)
        else:  # a fresh epoch's totals are zero everywhere (no collective outside the steps)
            for m in tracked:
                m.set_global_totals(m.local_totals())
            if self.failover is not None:
                self.failover.record(epoch, self.batches.state_dict(), 0, state.iterations, tracked)
        if self._agreed_facts is None:  # after the first record: a replica lost now is gone on without
            self._going_on(self._agree_callbacks)
        state.samples = int(tracked[0].global_totals()[1])
        steps.set_training(True)
        self.cblist.call("on_epoch_begin", epoch, None)
        self._train()
        if state.step == 0:  # on every replica alike (each reads the same global batches)
            raise ValueError(
                f"fit read no batch in epoch {epoch + 1}: the data is empty, so nothing was trained "
                "(Keras raises here too); check the dataset's length, a filter that drops everything, "
                "or drop_remainder=True on fewer examples than one global batch"
            )
        logs = _logs(tracked)
        if self.validation is not None:
            steps.set_training(False)
            validation = self.validation
            val = self._going_on(lambda: _run_test(self.strategy, steps, validation[0], self.val_tracked, self.cblist,
                                                   validation[1], "fit's validation_data"))  # fmt: skip
            logs.update({f"val_{k}": v for k, v in val.items()})
            steps.set_training(True)
        self.history.record(epoch, logs)
        self.cblist.call("on_epoch_end", epoch, logs)  # callbacks may add logs (learning_rate)
        self.history.update_last(logs)
        if self.epoch_scheduler is not None:
            self.epoch_scheduler.step()
        return logs

    def _train(self) -> None:
        """The epoch's executions: up to ``cadence.size`` steps in one ``strategy.run``, then one sync."""
        state, cadence, tracked = self.state, self.cadence, self.tracked
        retry: list[Any] | None = None
        while True:
            group = retry if retry is not None else self._take(cadence.size * self.accumulate)
            retry = None
            if not group:
                return
            self.cblist.call("on_train_batch_begin", state.step, None)
            t0 = time.perf_counter()
            try:
                in_steps = self.steps.train(group, tracked[0], tracked[1:])
                t1 = time.perf_counter()
                state.step += len(group)
                state.iterations += len(group)
                # the sync also carries whether a callback asked to stop before this execution's
                # end (on_epoch_begin, on_train_batch_begin): every replica stops after this batch,
                # as Keras does, at no extra collective
                proposal = cadence.proposal(t1 - t0, in_steps, len(group))
                # under on_failure="continue" the step's commit summed the metrics, the stop and
                # whether a replica came back (its proposal is empty: one step per execution)
                committed = self.steps.committed_extra if self.failover is not None else None
                summed = _end_execution(self.strategy, tracked, state, self.cblist,
                                        [float(_stop_asked(state)), *proposal], committed)  # fmt: skip
                if committed is not None and self.failover is not None:
                    stop, joins = committed
                    if joins > 0:  # let it in now, between two steps
                        self.failover.let_in(self)
                    summed = [stop]
            except CollectiveError as e:
                if self.failover is None:
                    raise
                self.failover.interrupted(t0)
                retry = self._recover(e, group)
                continue
            if cadence.measuring:
                cadence.timed(len(group), t1 - t0, in_steps, time.perf_counter() - t1)
                cadence.agreed(summed[1:], self.strategy.num_replicas_in_sync)
            # asked in on_train_batch_end (Keras checks after each batch): agreed now, so every
            # replica stops after this batch (one small collective, only with such callbacks)
            # (on_failure="continue": a replica lost in a callback, after the commit, is gone on
            # without here, and the survivors agree again)
            if summed[0] > 0 or (self.per_batch_stop and self._going_on(lambda: self.steps.agree(_stop_asked(state)))):
                state.stop_training = True
                _set_model_flag(state.model, True)
                return
