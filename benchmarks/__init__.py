"""Speed of keras_replicator against stock TensorFlow, measured side by side in one run.

Run ``python -m benchmarks`` (``make bench``; about 10 minutes on 2 CPU cores) or
``python -m benchmarks --quick`` (``make bench-quick``; a smoke run of about a
minute). Each configuration (a model under one strategy on K devices, an
all-reduce implementation, ...) runs in its own fresh interpreter
(``python -m benchmarks.worker SPEC``), because the number of simulated CPU
devices is fixed when TensorFlow starts; the configurations are run in
interleaved rounds, so that drift of a shared machine hits all of them alike,
and every figure is the median of several timed windows after a warm-up.

Modules:
    runner: the plan of configurations, the rounds, the JSON/Markdown/PNG outputs.
    worker: one configuration in one process; prints ``RESULT {json}``.
    report: the Markdown table of ratios and the plot, from the JSON.
"""
