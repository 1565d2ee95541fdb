"""core: the ground floor every layer may use: nested values (``tree``) and batches (``batches``)."""
