"""Planning a run before spending on it: model FLOPs (``flops``), per-rank memory (``memory_model``)
and the dry run that builds the parallel model on fake ranks (``dry_run``)."""
