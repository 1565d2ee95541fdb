"""cli: the ``stratagem`` command (run, demo, bench)."""
