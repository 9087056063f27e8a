"""Speed of keras_replicator against stock TensorFlow, measured side by side in one run.

Run ``python -m benchmarks`` (``make bench``; 8-10 minutes on 2 CPU cores) or
``python -m benchmarks --quick`` (``make bench-quick``; a smoke run of about a
minute and a half). Each configuration (a model under one strategy on K devices,
an all-reduce implementation, ...) runs in its own fresh interpreter
(``python -m benchmarks.worker SPEC``), because the number of simulated CPU
devices is fixed when TensorFlow starts. The configurations a table compares
take turns window by window, so that drift of a shared machine hits all of them
alike; every figure is the median of timed windows after a warm-up, and every
ratio between configurations that took turns the median of window-by-window
ratios, with a 90% interval. Round 1 has a time limit (13.5 minutes in full
mode): a group past its deadline takes fewer windows, and the outputs say so.

Modules:
    runner: the plan of configurations, the rounds, the JSON/Markdown/PNG outputs.
    worker: one configuration in one process; prints ``RESULT {json}``.
    report: the Markdown table of ratios and the plot, from the JSON.
"""
