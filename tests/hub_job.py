"""The KerasHub job tests/test_kerashub.py runs on 2 local workers (not a test module).

Usage (every worker runs the same command, as ``keras-replicator launch`` does)::

    python tests/hub_job.py OUT_DIR

Each worker fine-tunes the tiny GPT-2 causal LM of ``tests/hub_models.py`` on the
local text, from strings (the preprocessor runs in ``tf.data``), as the test's
one-device reference does, and writes its losses and weights to
``OUT_DIR/worker{i}.json`` / ``.npz``.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import keras_replicator as kr  # noqa: E402

kr.simulate_devices(1)  # the launcher's --devices-per-worker wins
strategy = kr.ReplicatorStrategy()

import numpy as np  # noqa: E402

from tests import hub_models  # noqa: E402


def main(out_dir: str) -> None:
    with strategy.scope():
        model = hub_models.gpt2_causal_lm(hub_models.gpt2_tokenizer())
        hub_models.compile_causal_lm(model)
    history = model.fit(hub_models.TEXT, **hub_models.FIT)
    report = {"worker_index": strategy.worker_index, "num_replicas": strategy.num_replicas_in_sync,
              "loss": history.history["loss"]}
    name = os.path.join(out_dir, f"worker{strategy.worker_index}")
    with open(name + ".json", "w") as f:
        json.dump(report, f)
    np.savez(name + ".npz", *model.get_weights())


if __name__ == "__main__":
    main(sys.argv[1])
