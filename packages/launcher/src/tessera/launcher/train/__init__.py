"""Training: ``boost()`` (TP and context parallelism, then PP, then ZeRO / DP, as named steps),
the `Engine` it returns, each way of splitting a batch and its loss (``objective``), the first-step
check against serial (``verify``, ``twin``), deferred initialization, activation recompute,
per-block compile, and expert parallelism (``experts``, ``moe_style``)."""
