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

Modules of ``python -m benchmarks``, one per concept:

The run (in the parent process):
    runner: the command line and the output files (JSON, Markdown, PNG).
    plan: the settings and the configurations (``Settings``, ``Config``, ``plan``).
    rounds: the rounds and round 1's time limit.
    processes: worker processes, alone or a group taking turns window by window.
    results: the JSON document (each configuration's figures over its rounds).

One configuration (in a worker process):
    worker: ``python -m benchmarks.worker SPEC``: runs the spec's kind, prints its result.
    protocol: the worker's command line, its ``RESULT`` line and its turns.
    window_clock: warm-up, then timed windows.
    devices: simulated devices and the strategies over them.
    models, synthetic_data: the models trained and the data they read.
    machine, allreduce, training_throughput, multiworker: the kinds of measurement.

The outputs (from the JSON):
    tables (with xla_table): the Markdown tables.
    targets: the targets, measured and met or not.
    plot: the PNG.
    entries, ratios, formatting: the entries a row compares, their paired ratios and
    90% intervals, how figures are written.

Other studies, each with its own command: ``first_step``, ``d4pg``, ``async_throughput``,
``sngan_batch_size``, ``input_pipeline``, ``iterator_stall``, ``replica_work``, ``remat_memory``,
``model_parallel``, ``model_parallel_budget`` (each lever's memory per device, the largest model in
1 GiB per device, step time paired against replicated), ``backup_soak`` (random SIGKILLs and restarts against the crash-consistent
backups; what the commit costs), ``peers`` (with ``peers_worker``: ours against stock
``MirroredStrategy`` and Keras on JAX, fresh processes, ``make bench-peers``), ``engine_steady``
(the default engine's steady step paired against ``trace_once=False`` and one device), ``onednn``
(TensorFlow's CPU kernels with oneDNN off and on, each in a fresh process).
"""
