"""Worker functions of the real-models suite (run by stratagem.testing.run_workers)."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Any

import real_cases as M
import torch
from torch import nn

import stratagem
from stratagem.distribute import compute_average_loss
from stratagem.train.checkpoint import load_state_dict

SEED = 0


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict(keep_vars=True).items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone().cpu()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    keys = [k for k in a if not M.is_statistic(k)]
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in keys)


def quiet_build(case: M.Case) -> nn.Module:
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT prints its parameter count
        return case.build()


def quiet_optimizer(case: M.Case, model: nn.Module) -> torch.optim.Optimizer:
    with contextlib.redirect_stdout(io.StringIO()):  # and its optimizer groups
        return case.optimizer(model)


def clip(case: M.Case, model: nn.Module) -> None:
    """Global-norm clipping as a custom loop writes it. Under ModelParallelStrategy the split
    layers' gradients are DTensors and the others plain tensors, which one call of torch's
    clip_grad_norm_ refuses to mix: the norm is taken per kind, then combined."""
    norm = case.fit_kwargs.get("global_clipnorm")
    if norm is None:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    kinds = [[p for p in params if hasattr(p.grad, "full_tensor") == split] for split in (False, True)]
    kinds = [k for k in kinds if k]
    if len(kinds) == 1:
        torch.nn.utils.clip_grad_norm_(params, norm)
        return
    norms = []
    for same in kinds:
        n = torch.nn.utils.get_total_norm([p.grad for p in same])
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for same in kinds:
        torch.nn.utils.clip_grads_with_norm_(same, norm, total)


def logits_of(model: nn.Module, case: M.Case) -> torch.Tensor | None:
    """The trained model's logits on every batch (Hugging Face models), on one device."""
    if case.name in ("nanogpt", "resnet"):  # (a ResNet's in eval mode: its running statistics)
        return None
    with torch.no_grad():
        return torch.cat([model(**x).logits for x, _ in case.batches()])


def reference(case: M.Case) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, plain torch: the initial and the trained state."""
    torch.manual_seed(SEED)
    model = quiet_build(case)
    opt = quiet_optimizer(case, model)
    init = full_state(model)
    for x, y in case.batches():
        opt.zero_grad()
        for part in range(case.shares):  # BatchNorm: each replica's share on its own
            xs = {k: v.chunk(case.shares)[part] for k, v in x.items()}
            (case.step_loss(model(**xs), y.chunk(case.shares)[part]).sum() / y.shape[0]).backward()
        clip(case, model)
        opt.step()
    LOGITS[case.name] = logits_of(model, case)
    return init, full_state(model)


LOGITS: dict[str, torch.Tensor | None] = {}


def under(strategy: Any, case: M.Case, how: str, ckpt: str | None = None) -> dict[str, Any]:
    torch.manual_seed(SEED)
    with strategy.scope():
        model = quiet_build(case)
        opt = quiet_optimizer(case, model)
    got: dict[str, Any] = {"init": full_state(model), "tied": M.tied(model)}
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    got["param_share"] = local / sum(p.numel() for p in model.parameters())
    if how == "fit":
        history = stratagem.fit(model, opt, case.loss_fn, case.batches(), verbose=0, **case.fit_kwargs)
        got["epochs"] = len(history.history["loss"])
        got["eval"] = stratagem.evaluate(model, case.loss_fn, case.batches(), metrics=case.fit_kwargs.get("metrics", ()),
                                         return_dict=True)
        want = LOGITS.get(case.name)
        if want is not None:  # predict of a ModelOutput: a dict of its per-example entries
            pred = stratagem.predict(model, [x for x, _ in case.batches()])
            got["predict"] = (sorted(pred), float((pred["logits"] - want).abs().max()))
    else:  # the custom loop: scope, distributed data, run, reduce
        def step(x: Any, y: Any) -> torch.Tensor:
            opt.zero_grad()
            loss = compute_average_loss(case.step_loss(model(**x), y))
            loss.backward()
            clip(case, model)
            opt.step()
            return loss.detach()

        for x, y in strategy.experimental_distribute_dataset(case.batches()):
            strategy.run(step, args=(x, y))
    got["trained"] = full_state(model)
    got["tied_after"] = M.tied(model)
    if ckpt is not None:  # saved, then restored into a model built from another seed
        got["ckpt"] = save_and_restore(strategy, case, model, opt, ckpt)
    return got


def save_and_restore(strategy: Any, case: M.Case, model: nn.Module, opt: Any, directory: str) -> dict[str, Any]:
    saved = stratagem.CheckpointManager(stratagem.Checkpoint(model=model, optimizer=opt), directory).save(1)
    torch.manual_seed(SEED + 1)
    with strategy.scope():
        fresh = quiet_build(case)
        fresh_opt = quiet_optimizer(case, fresh)
    manager = stratagem.CheckpointManager(stratagem.Checkpoint(model=fresh, optimizer=fresh_opt), directory)
    manager.restore(saved)
    out: dict[str, Any] = {"diff": max_diff(full_state(fresh), full_state(model)), "tied": M.tied(fresh)}
    root = Path(saved)
    if (root / "sharded").exists():  # torch.distributed.checkpoint: the names it wrote
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(root / "sharded")).read_metadata().state_dict_metadata
        out["saved_names"] = sorted(k for k in keys if k.startswith("model.") and ("wte" in k or "lm_head" in k))
    else:  # whole tensors: one tensor, read back under both names
        state = load_state_dict(saved)
        out["saved_names"] = sorted(k for k in state if "wte" in k or "lm_head" in k)
        out["one_tensor"] = state["lm_head.weight"] is state["transformer.wte.weight"]
    return out


def data_parallel(names: list[str], tmp: str) -> dict[str, Any]:
    """Every case under Mirrored(2) and Sharded(2), through fit and the custom loop."""
    logging.getLogger("stratagem").setLevel(logging.INFO)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("stratagem").addHandler(handler)
    strategies = {"mirrored": stratagem.MirroredStrategy("cpu"), "sharded": stratagem.ShardedStrategy(devices="cpu")}
    out: dict[str, Any] = {}
    for name in names:
        case = M.CASES[name]
        init, trained = reference(case)
        want_tied = M.tied(quiet_build(case))
        for sname, s in strategies.items():
            for how in ("fit", "loop"):
                ckpt = f"{tmp}/{name}-{sname}" if how == "fit" and name == "nanogpt" else None
                got = under(s, case, how, ckpt)
                out[f"{name}/{sname}/{how}"] = {
                    "init_diff": max_diff(got["init"], init),
                    "diff": max_diff(got["trained"], trained),
                    "tied": (got["tied"], got["tied_after"], want_tied),
                    "param_share": got["param_share"],
                    "epochs": got.get("epochs"),
                    "eval": got.get("eval"),
                    "ckpt": got.get("ckpt"),
                    "predict": got.get("predict"),
                }
    out["log"] = log.getvalue()
    return out


def pieces(x: Any, n: int) -> list[Any]:
    """``x`` (a tensor or a dict of tensors) in ``n`` pieces along the batch."""
    if isinstance(x, dict):
        parts = {k: v.chunk(n) for k, v in x.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    return list(x.chunk(n))


def pipeline(names: list[str], data_parallel: int = 1, sharded: bool = False, tensor: bool = False) -> dict[str, Any]:
    """GPTs in 2 stages (embeddings + block 0 | block 1 + head: the tie crosses the stages), BERT
    (its padding mask crossing beside the hidden states), a ResNet, through fit and the custom
    loop, against the unsplit model on one device; with ``data_parallel`` copies of the pipeline,
    each stage's gradients also summed over copies; ``sharded``: each stage's layers sharded over
    the copies (``sharding=ShardingOptions()``); ``tensor``: each stage's attention and MLP split
    over 2 processes (``layout_map=``, nanoGPT's column / row pairs, as under ModelParallelStrategy)."""
    layout = None
    if tensor:
        layout = stratagem.LayoutMap(stratagem.DeviceMesh((2,), ("model",)))
        layout[r"mlp\.c_fc\.weight"] = ("model", None)
        layout[r"mlp\.c_proj\.weight"] = (None, "model")
        layout[r"attn\.c_attn\.weight"] = ("model", None)
        layout[r"attn\.c_proj\.weight"] = (None, "model")
    s = stratagem.PipelineStrategy(
        num_stages=2, num_microbatches=2, balance=[2, 2], data_parallel=data_parallel,
        sharding=stratagem.ShardingOptions() if sharded else None, layout_map=layout,
    )  # fmt: skip
    out: dict[str, Any] = {}
    for name in names:
        case = M.CASES[name]
        per_example = {"nanogpt": M.token_mean, "gpt2": M.shifted_token_mean, "resnet": M.class_mean,
                       "bert": M.class_mean}[name]
        batches = M.pipeline_batches(name)

        def mean_loss(logits: torch.Tensor, y: torch.Tensor, per_example: Any = per_example) -> torch.Tensor:
            return per_example(logits, y).mean()

        # the split points are faithful: the layers in a row compute the model's own forward
        torch.manual_seed(SEED)
        whole = quiet_build(case).eval()
        x0, y0 = batches[0]
        with torch.no_grad():
            if name == "nanogpt":
                own = whole(x0, y0)[0]
            elif name == "bert":
                own = whole(**x0).logits
            else:
                own = whole(**{"input_ids" if name == "gpt2" else "pixel_values": x0}).logits
            split_diff = float((M.stages_of(name, whole)(x0) - own).abs().max())
            mask_matters = 0.0
            if name == "bert":  # the padding mask matters: without it the hidden states differ
                masked = whole.bert(**x0).last_hidden_state
                unmasked = whole.bert(input_ids=x0["input_ids"]).last_hidden_state
                mask_matters = float((unmasked - masked).abs().max())
        # nanoGPT is clipped as train.py clips (global norm, at 0.3 so it acts on every step): the
        # norm over both stages, the tie crossing them counted once
        norm = case.fit_kwargs.get("global_clipnorm")

        def decay(step: int, acts: bool = norm is not None) -> float:  # and a learning rate set every update, as train.py's
            return 1.0 / (1.0 + step) if acts else 1.0

        # one device: the unsplit model, the same layers
        torch.manual_seed(SEED)
        ref = M.stages_of(name, quiet_build(case))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, decay)
        init = full_state(ref)
        for x, y in batches:
            ref_opt.zero_grad()
            chunks = 2 * data_parallel  # 2 micro-batches per copy (BatchNorm: each its own)
            for xs, ys in zip(pieces(x, chunks), y.chunk(chunks)):
                (per_example(ref(xs), ys).sum() / y.shape[0]).backward()
            if norm is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), norm)
            ref_opt.step()
            ref_schedule.step()
        want = full_state(ref)
        for how in ("fit", "loop"):
            torch.manual_seed(SEED)
            seq = M.stages_of(name, quiet_build(case))  # built on the CPU: the model's own init
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                pipe = s.pipeline(seq, mean_loss, loss_reduction="mean")
            got_init = {k: v.clone() for k, v in pipe.state_dict().items()}
            with s.scope():
                opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, decay)
            if how == "fit":
                stratagem.fit(pipe, opt, per_example, batches, verbose=0, lr_scheduler=schedule,
                              lr_scheduler_interval="step", **({"global_clipnorm": norm} if norm is not None else {}))
            else:
                for x, y in s.experimental_distribute_dataset(batches):
                    s.run(pipe.train_step, args=(x, y))
                    if norm is not None:
                        pipe.clip_grad_norm_(norm)
                    opt.step()
                    schedule.step()
                    opt.zero_grad()
            got = pipe.state_dict()
            with torch.no_grad():  # predict: the output travels back to every stage of a copy
                pipe.eval()
                ref.eval()
                predict_diff = float((pipe.predict(x0) - ref(x0)).abs().max())
                pipe.train()
                ref.train()
            out[f"{name}/pipeline/{how}"] = {
                "predict_diff": predict_diff,
                "names": sorted(got),
                # (pipe.state_dict() also lists non-persistent buffers: BERT's position ids)
                "init_diff": max(float((got_init[k] - init[k]).abs().max()) for k in got_init if k in init),
                "diff": max(float((got[k] - want[k]).abs().max()) for k in got if k in want and not M.is_statistic(k)),
                "printed": printed.getvalue(),
                "split_diff": split_diff,
                "mask_matters": mask_matters,
                # this stage's end of the tie (embedding on stage 0, head on stage 1)
                "tied_end": (got.get("0.wte.weight") if s.extended.stage == 0 else got.get("3.lm_head.weight")),
                "stage": s.extended.stage,
                "plan": [p for plan in s.extended.plans for p in plan.items()],
            }
    # a tie across stages in a model built on the meta device cannot be replayed: refused
    class Head(nn.Module):
        def __init__(self, emb: nn.Embedding) -> None:
            super().__init__()
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(x)

    try:
        with s.scope():
            emb = nn.Embedding(10, 4)
            s.pipeline(nn.Sequential(emb, nn.Identity(), nn.Identity(), Head(emb)), nn.CrossEntropyLoss(), verbose=False)
    except ValueError as e:
        out["meta_tie_error"] = str(e)
    # the model's own loss needs the whole output on one process: not under a pipeline
    with s.scope():
        plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    try:
        stratagem.fit(plain, plain_opt, None, [(torch.zeros(4, 4), torch.zeros(4, dtype=torch.long))], verbose=0)
    except ValueError as e:
        out["no_loss_fn_error"] = str(e)
    return out


def model_parallel(names: list[str]) -> dict[str, Any]:
    """nanoGPT under ModelParallelStrategy on a ("model",) mesh of 2: the MLP's first matmul
    column-parallel and its second row-parallel (Megatron's pair), the rest replicated."""
    mesh = stratagem.DeviceMesh((2,), ("model",))
    layout = stratagem.LayoutMap(mesh)
    layout[r"mlp\.c_fc\.weight"] = ("model", None)
    layout[r"mlp\.c_proj\.weight"] = (None, "model")
    layout[r"attn\.c_attn\.weight"] = ("model", None)
    layout[r"attn\.c_proj\.weight"] = (None, "model")
    # GPT-2's Conv1D layers hold their weights (in, out): the same split, the other dimension
    conv = stratagem.LayoutMap(mesh)
    conv[r"(attn\.c_attn|mlp\.c_fc)\.weight"] = (None, "model")
    conv[r"(attn|mlp)\.c_proj\.weight"] = ("model", None)
    strategies = {"nanogpt": stratagem.ModelParallelStrategy(mesh, layout),
                  "gpt2": stratagem.ModelParallelStrategy(mesh, conv)}  # fmt: skip
    out: dict[str, Any] = {}
    for name in names:
        case = M.CASES[name]
        s = strategies[name]
        init, trained = reference(case)
        for how in ("fit", "loop"):
            got = under(s, case, how)
            out[f"{name}/model_parallel/{how}"] = {
                "init_diff": max_diff(got["init"], init),
                "diff": max_diff(got["trained"], trained),
                "tied": (got["tied"], got["tied_after"]),
                "plan": dict(s.extended.plans[-1]),
            }
    # a layout splitting one end of the tie (the embedding) and not the other: a clear error
    split_tie = stratagem.LayoutMap(mesh)
    split_tie[r"wte\.weight"] = ("model", None)
    bad = stratagem.ModelParallelStrategy(mesh, split_tie)
    try:
        with bad.scope():
            kept = quiet_build(M.CASES["nanogpt"])  # noqa: F841 - alive when the scope closes
    except ValueError as e:
        out["split_tie_error"] = str(e)
    return out
