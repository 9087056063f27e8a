"""Batches with fewer rows than replicas on 2 workers x 2 replicas (issue 50), against one device.

One job (``tests/multi_worker_job.py short``) runs every row count of the families
whose results depend on counts summed over the workers
(`short_batches_cases.MULTI_WORKER_FAMILIES`; tests/test_short_batches.py runs every
family on 4 replicas) on 2 local workers (127.0.0.1) through the launcher; the
one-device reference is computed here, meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import warnings

import numpy as np
import pytest

from keras_replicator import launch as launcher
from tests import short_batches_cases as cases
from tests.helpers import launch_env
from tests.test_multi_worker import JOB

pytestmark = pytest.mark.devices(1)


def _fields(arrays: dict, family: str, rows: int) -> dict:
    prefix = f"{family}/{rows}/"
    got = {}
    for key, value in arrays.items():
        if key.startswith(prefix):
            _, _, field, i = key.split("/")
            got.setdefault(field, {})[int(i)] = value
    return {field: [v[i] for i in sorted(v)] if field == "weights" else v[0] for field, v in got.items()}


def _one_device_results() -> dict:
    """{(family, rows): `cases.run_case`'s results} on one device (no strategy in this process)."""
    results = {}
    for family in cases.MULTI_WORKER_FAMILIES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = cases.build(family)
        initial = reference.get_weights()
        for rows, batch_size in cases.ROWS:
            results[family, rows] = cases.run_case(reference, family, rows, batch_size, initial)
    return results


def test_every_family_and_row_count_on_two_workers_gives_one_devices_results(tmp_path):
    out = io.StringIO()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # One device's results while the workers run (this process only waits for them).
        one_device = pool.submit(_one_device_results)
        code = launcher.launch(JOB, ["short", str(tmp_path)], workers=2, devices_per_worker=2,
                               env=launch_env(), timeout=900, output=out)
        assert code == 0, out.getvalue()[-4000:]
        reference = one_device.result()
    workers = []
    for i in range(2):
        with np.load(os.path.join(tmp_path, f"short{i}.npz")) as f:
            workers.append(dict(f))
    for family in cases.MULTI_WORKER_FAMILIES:
        for rows, _ in cases.ROWS:
            want = reference[family, rows]
            for arrays in workers:
                got = _fields(arrays, family, rows)
                np.testing.assert_allclose(got["predict"], want["predict"], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{family} {rows} predict")
                np.testing.assert_allclose(got["evaluate"], want["evaluate"], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{family} {rows} evaluate")
                assert np.all(np.isfinite(got["fit_loss"]))
                if cases.fit_comparable(family, rows):
                    np.testing.assert_allclose(got["fit_loss"], want["fit_loss"], rtol=1e-5, atol=1e-6,
                                               err_msg=f"{family} {rows} fit loss")
                    for g, w in zip(got["weights"], want["weights"], strict=True):
                        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{family} {rows} weights")
