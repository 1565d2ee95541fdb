"""``stratagem.experimental``: tf.config.experimental's determinism switch, as in TensorFlow.

``enable_op_determinism()`` makes ``fit`` give the same bits on one process and on any number of
data-parallel replicas (docs/design/DETERMINISM.md); ``disable_op_determinism()`` turns it off.
"""

from __future__ import annotations

from stratagem.distribute.determinism import (
    disable_op_determinism,
    enable_op_determinism,
    op_determinism,
)

__all__ = ["disable_op_determinism", "enable_op_determinism", "op_determinism"]
