"""stratagem.data: a tf.data-style input pipeline (depends on nothing else in the package)."""
