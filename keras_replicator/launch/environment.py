"""The environment variables the launcher sets in every worker it starts, and the exit status it reads."""

# Read by ReplicatorStrategy (through cluster.py) at creation: simulate this many
# CPU devices per worker. The launcher sets it for --devices-per-worker.
DEVICES_PER_WORKER_ENV = "KERAS_REPLICATOR_DEVICES_PER_WORKER"
# Set for each launched worker: its index, so scripts and logs can tell them apart.
WORKER_INDEX_ENV = "KERAS_REPLICATOR_WORKER_INDEX"
# Set for each launched worker: 0 at the first start, k at the k-th restart (--max-restarts).
RESTART_COUNT_ENV = "KERAS_REPLICATOR_RESTART_COUNT"

# Set for each launched worker: the file the chief records its last backup's save time in
# (keras_replicator.atomic_files.SAVE_RECORD_ENV, the same name), read by launch.grace.
SAVE_RECORD_ENV = "KERAS_REPLICATOR_SAVE_RECORD"

# What a worker exits with after a preemption (SIGTERM during fit: it saved, "restart me"):
# the value of keras_replicator._compat.preemption.EXIT_CODE (not imported: no TensorFlow here).
PREEMPTED_EXIT_CODE = 143
