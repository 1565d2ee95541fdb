"""stratagem.metrics: the metrics of ``stratagem.train.metrics`` (and its count-based and torchmetrics ones) under their public name."""

from stratagem.train import confusion_metrics as _confusion
from stratagem.train import metrics as _metrics
from stratagem.train.confusion_metrics import *  # noqa: F403
from stratagem.train.metrics import *  # noqa: F403
from stratagem.train.torchmetrics_metric import TorchMetric

__all__ = [*_metrics.__all__, *_confusion.__all__, "TorchMetric"]
