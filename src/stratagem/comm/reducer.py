"""The bucketed gradient reducer: sums (or averages) gradients across replicas during backward.

One hook per parameter (``register_post_accumulate_grad_hook``) marks its gradient ready; when
every parameter of the next bucket in plan order is ready, the bucket is copied into a flat
buffer and its all-reduce starts asynchronously, so communication overlaps the rest of the
backward pass. Buckets start strictly in index order on every replica. At the end of the
backward pass (an autograd engine callback) the buckets not yet started are started, every
reduction is waited for and the results are written back to ``.grad``, so the gradients are
final before ``backward()`` returns. Each parameter carries one extra flag element in its bucket
(1 if this replica produced a gradient for it in this backward pass): a parameter no replica
touched keeps its ``.grad``; one touched anywhere gets the reduced gradient on every replica. The reduced gradients are views
of the bucket buffers (as DDP's ``gradient_as_bucket_view``): the next backward pass overwrites
them, so clone a gradient you want to keep across steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stratagem.comm.buckets import Bucket, ParamSpec, plan_buckets
from stratagem.comm.communicator import Communicator


def param_specs(params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> list[ParamSpec]:
    return [
        ParamSpec(n, p.numel(), p.element_size(), str(p.dtype).replace("torch.", ""), str(p.device))
        for p, n in zip(params, names)
    ]


class GradientReducer:
    """Reduces the gradients of ``params`` across ``comm`` in buckets, overlapped with backward."""

    def __init__(
        self,
        comm: Communicator,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        *,
        op: str = "sum",
        first_bucket_bytes: int | None = None,
        bucket_bytes: int | None = None,
    ) -> None:
        if op not in ("sum", "mean"):
            raise ValueError(f"gradients can be reduced by 'sum' or 'mean', not {op!r}")
        self.comm = comm
        self.params = list(params)
        self.op = op
        kw: dict[str, int] = {}
        if first_bucket_bytes is not None:
            kw["first_cap"] = first_bucket_bytes
        if bucket_bytes is not None:
            kw["cap"] = bucket_bytes
        self.buckets: tuple[Bucket, ...] = plan_buckets(param_specs(self.params, names), **kw)
        self._bucket_of: dict[int, int] = {}
        for b in self.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index
        self._buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._handles: list[Any] = []
        self._reset()
        self.enabled = True
        if comm.world_size > 1:
            for i, p in enumerate(self.params):
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    # --- per-backward state ---------------------------------------------------------------
    def _reset(self) -> None:
        self._ready: list[int] = [0] * len(self.buckets)
        self._touched: set[int] = set()
        self._next = 0
        self._works: list[tuple[Bucket, torch.Tensor, Any]] = []
        self._armed = False

    def _hook(self, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if not self.enabled:
                return
            if not self._armed:
                self._armed = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            if i in self._touched:
                return
            self._touched.add(i)
            self._ready[self._bucket_of[i]] += 1
            self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if self._ready[b.index] < len(b.params):
                return
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        buf = self._buffers[b.index]
        n = len(b.params)
        if buf is None:
            p0 = self.params[b.params[0]]
            buf = torch.empty(b.numel + n, dtype=p0.dtype, device=self.comm.device)
            self._buffers[b.index] = buf
        for k, (i, off) in enumerate(zip(b.params, b.offsets)):
            p = self.params[i]
            view = buf[off : off + p.numel()]
            if i in self._touched and p.grad is not None:
                if p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad.reshape(-1))
                buf[b.numel + k] = 1
            else:
                view.zero_()
                buf[b.numel + k] = 0
        self._works.append((b, buf, self.comm.all_reduce_async(buf)))
        self._next += 1

    def _finalize(self) -> None:
        try:
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
            for b, buf, work in self._works:
                work.wait()
                if self.op == "mean":
                    buf[: b.numel].div_(self.comm.world_size)
                flags = buf[b.numel :].tolist()
                for k, (i, off) in enumerate(zip(b.params, b.offsets)):
                    if flags[k] == 0:
                        continue
                    p = self.params[i]
                    # the reduced gradient stays in the bucket (DDP's gradient_as_bucket_view):
                    # no copy out, and a zero_grad(set_to_none=False) step accumulates in place
                    p.grad = buf[off : off + p.numel()].view(p.shape)
        finally:
            self._reset()

    def remove(self) -> None:
        """Stop reducing (hooks removed)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
