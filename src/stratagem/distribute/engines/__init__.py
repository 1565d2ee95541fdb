"""engines: what strategies are made of: the data-parallel engine, mirrored variables,
distributed input, and the pipeline engine. Strategies compose these; the API never imports them."""
