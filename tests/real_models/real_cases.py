"""The real models of the suite, built from small configs (no download), and their data.

Each case: ``build()`` makes the model exactly as its authors' code does (in a strategy's scope
or on one device), ``optimizer(model)`` its optimizer, ``batches()`` the global batches
``(x, y)`` (``x`` a dict of keyword inputs, attention masks included), ``loss_fn`` what fit
minimizes (None: the model's own ``loss``) and ``step_loss(out, y)`` the per-example losses a
custom loop computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

B, T, VOCAB, STEPS = 8, 16, 32, 3


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batches: Callable[[], list[tuple[Any, Any]]]
    loss_fn: Any  # what fit gets
    step_loss: Callable[[Any, Any], torch.Tensor]  # per-example losses for the custom loop
    fit_kwargs: dict[str, Any]
    # BatchNorm in training mode normalizes with the statistics of the batch it sees: each
    # replica's (or micro-batch's) share, as under DDP (no SyncBatchNorm on CPU). The reference
    # is then one device running the same shares one after another, summing the gradients
    shares: int = 1


def _tokens(seed: int, masked: bool) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (B, T), generator=g)
        targets = torch.randint(0, VOCAB, (B, T), generator=g)
        x: dict[str, torch.Tensor] = {"input_ids": ids}
        if masked:  # the last positions of every other sequence are padding
            mask = torch.ones(B, T, dtype=torch.long)
            mask[::2, T - 3 :] = 0
            x["attention_mask"] = mask
        out.append((x, targets))
    return out


# --- nanoGPT as published ----------------------------------------------------------------------
def nanogpt_config() -> Any:
    from nanogpt_model import GPTConfig

    return GPTConfig(block_size=T, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)


def nanogpt() -> nn.Module:
    from nanogpt_model import GPT

    return GPT(nanogpt_config())


def nanogpt_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # nanoGPT's own AdamW groups (weight decay on matrices only)
    return model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu")  # type: ignore[operator]


def nanogpt_batches() -> list[tuple[Any, Any]]:
    # nanoGPT's forward(idx, targets): passed by keyword (fit calls model(**x))
    return [({"idx": x["input_ids"], "targets": y}, y) for x, y in _tokens(1, masked=False)]


def token_losses(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Per-example mean cross-entropy over the tokens; ``out`` is nanoGPT's (logits, loss) or logits."""
    logits = out[0] if isinstance(out, tuple) else out
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


# --- Hugging Face -------------------------------------------------------------------------------
def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def gpt2_batches() -> list[tuple[Any, Any]]:
    # labels inside x: the model computes its own loss (shifted, every position counted, so
    # every example weighs alike in its mean)
    return [({**x, "labels": y}, y) for x, y in _tokens(2, masked=True)]


def hf_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """The model's own loss (its batch mean) as per-example losses."""
    return out.loss.expand(y.shape[0])


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=T, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def bert_batches() -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(3)
    return [(x, torch.randint(0, 3, (B,), generator=g)) for x, _ in _tokens(3, masked=True)]


def classify_losses(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, y, reduction="none")


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic", num_labels=3)
    return ResNetForImageClassification(cfg)


def image_batches() -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(4)
    return [({"pixel_values": torch.randn(B, 3, 16, 16, generator=g)}, torch.randint(0, 3, (B,), generator=g))
            for _ in range(STEPS)]


CASES: dict[str, Case] = {
    # global-norm clipping as nanoGPT's train.py does, at 0.3 (not its 1.0) so it acts on every
    # step of this small model (gradient norms 0.81, 0.42, 0.41)
    "nanogpt": Case("nanogpt", nanogpt, nanogpt_optimizer, nanogpt_batches, token_losses, token_losses,
                    {"global_clipnorm": 0.3}),
    "gpt2": Case("gpt2", gpt2, adamw, gpt2_batches, None, hf_loss, {}),
    "bert": Case("bert", bert, adamw, bert_batches, nn.CrossEntropyLoss(), classify_losses, {"metrics": ["accuracy"]}),
    "resnet": Case("resnet", resnet, adamw, image_batches, nn.CrossEntropyLoss(), classify_losses,
                   {"metrics": ["accuracy"]}, shares=2),
}


def tied(model: nn.Module) -> bool | None:
    """Whether the input embedding and the output head are one parameter (None: no tie)."""
    if hasattr(model, "lm_head") and hasattr(model, "transformer"):
        return model.lm_head.weight is model.transformer.wte.weight
    return None


# --- pipeline split points: the model's own modules as an nn.Sequential of one-tensor layers --
class GPTEmbed(nn.Module):
    """A GPT's forward up to its blocks (token + position embeddings, dropout)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class GPTHead(nn.Module):
    """A GPT's final norm and output head (whose weight is the token embedding's)."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class HFBlock(nn.Module):
    """A Hugging Face GPT-2 block returning its hidden states only (one tensor between stages)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


class BertEmbed(nn.Module):
    """BERT's forward up to its first layer: the embeddings, the padding mask passed on as it came
    (an integer tensor: it crosses the stage boundaries beside the hidden states, no gradient)."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"hidden_states": self.embeddings(input_ids=x["input_ids"]), "attention_mask": x["attention_mask"]}


class BertBlock(nn.Module):
    """One BERT layer given the hidden states and the padding mask, which it turns into the
    attention mask exactly as ``BertModel.forward`` does (``create_bidirectional_mask``)."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer, self.config = layer, config

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from transformers.masking_utils import create_bidirectional_mask

        h = x["hidden_states"]
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=x["attention_mask"])
        return {"hidden_states": self.layer(h, mask), "attention_mask": x["attention_mask"]}


class BertHead(nn.Module):
    """BERT's pooler, dropout and classifier (BertForSequenceClassification after its encoder)."""

    def __init__(self, pooler: nn.Module, dropout: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.dropout, self.classifier = pooler, dropout, classifier

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(x["hidden_states"])))


class ImageHead(nn.Module):
    """A Hugging Face ResNet's pooling and classifier."""

    def __init__(self, pooler: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.classifier = pooler, classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(x))


def stages_of(name: str, model: nn.Module) -> nn.Sequential:
    """``model`` as the layers a pipeline splits: embeddings, each block, norm + head (a ResNet:
    its stem, each stage, pooling + classifier)."""
    if name == "resnet":
        r = model.resnet  # type: ignore[union-attr]
        return nn.Sequential(r.embedder, *r.encoder.stages, ImageHead(r.pooler, model.classifier))
    if name == "bert":  # stages pass {"hidden_states", "attention_mask"} on
        b = model.bert  # type: ignore[union-attr]
        blocks = [BertBlock(layer, model.config) for layer in b.encoder.layer]
        return nn.Sequential(BertEmbed(b.embeddings), *blocks, BertHead(b.pooler, model.dropout, model.classifier))
    t = model.transformer  # type: ignore[union-attr]
    blocks = list(t.h) if name == "nanogpt" else [HFBlock(b) for b in t.h]
    return nn.Sequential(GPTEmbed(t.wte, t.wpe, t.drop), *blocks, GPTHead(t.ln_f, model.lm_head))


def torch_gpipe(model: nn.Module, rank: int, microbatches: int, loss_fn: Any) -> tuple[nn.Module, nn.Parameter, Any]:
    """A GPT's 2-stage split (embeddings + 3 blocks | 3 blocks + head) as a user writes it with
    ``torch.distributed.pipelining``: this rank's part, its end of the tied embedding/head weight,
    and a ``ScheduleGPipe`` over ``microbatches``."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    layers = list(stages_of("nanogpt", model))
    part = nn.Sequential(*(layers[:4] if rank == 0 else layers[4:]))
    ends: Any = (part[0], part[-1])
    tied = ends[0].wte.weight if rank == 0 else ends[1].lm_head.weight
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    return part, tied, ScheduleGPipe(stage, microbatches, loss_fn=loss_fn)


def sum_tie(tied: nn.Parameter) -> None:
    """The tie by hand: the embedding's (stage 0) and the head's (stage 1) gradients summed."""
    import torch.distributed as dist

    grad = tied.grad if tied.grad is not None else torch.zeros_like(tied)
    dist.all_reduce(grad)
    tied.grad = grad


def token_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


def shifted_token_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """GPT2LMHeadModel's own loss (labels shifted by one) per example."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none").mean(dim=1)


def pipeline_batches(name: str) -> list[tuple[Any, torch.Tensor]]:
    """Token ids and targets (the GPTs: causal, no padding); images, labels; BERT's batches as
    they are ({"input_ids", "attention_mask"}, labels)."""
    if name == "resnet":
        return [(x["pixel_values"], y) for x, y in image_batches()]
    if name == "bert":
        return bert_batches()
    return [(x["input_ids"], y) for x, y in _tokens(1 if name == "nanogpt" else 2, masked=False)]


def class_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def is_statistic(key: str) -> bool:
    """BatchNorm's running statistics: per replica (rank 0's kept, as DDP does), not compared."""
    return "running_" in key or key.endswith("num_batches_tracked")
