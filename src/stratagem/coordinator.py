"""stratagem.coordinator: tf.distribute.coordinator (``ClusterCoordinator``, ``RemoteValue``) for ParameterServerStrategy."""

from stratagem.distribute.coordinator import *  # noqa: F403
from stratagem.distribute.coordinator import __all__  # noqa: F401
