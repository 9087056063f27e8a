"""``python -m benchmarks --quick`` runs and writes a complete, sane JSON, table and plot; its
groups, and groups past a deadline, take turns window by window; the other studies' commands."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.devices(1)  # the benchmarks start their own processes

SECTIONS = ("environment", "training", "batch_norm", "allreduce", "memcopy",
            "steps_per_execution", "multiworker", "input_pipeline", "failures")
PUBLISHED = [os.path.join(ROOT, "benchmarks", "results", name)
             for name in ("benchmarks.json", "benchmarks.md", "benchmarks.png")]
PUBLISHED.append(os.path.join(ROOT, "docs", "assets", "benchmarks.png"))


def _mtimes():
    return {p: os.path.getmtime(p) for p in PUBLISHED if os.path.exists(p)}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``python -m benchmarks --quick``: its ``main`` in this process (the workers are processes
    as ever), so that each group's worker results, with their windows' times, can be read too:
    the JSON keeps only the figures."""
    from benchmarks import rounds, runner

    out = tmp_path_factory.mktemp("bench")
    before = _mtimes()
    groups = []  # (specs, deadline, results) of every group, as run
    run_group = rounds.run_group

    def recorded_group(specs, timeout, deadline=None, min_windows=1):
        results = run_group(specs, timeout, deadline, min_windows=min_windows)
        groups.append((specs, deadline, results))
        return results

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(rounds, "run_group", recorded_group)
        # Each group's time limit is for hangs: sized for a loaded machine, not the quick default.
        status = runner.main(["--quick", "--timeout", "900", "--output-dir", str(out)])
    assert status == 0, stdout.getvalue()[-3000:]
    with open(out / "benchmarks.json") as f:
        doc = json.load(f)
    return SimpleNamespace(out=out, doc=doc, before=before, stdout=stdout.getvalue(), groups=groups)


def _positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _assert_took_turns(results, windows):
    """Each process timed ``windows`` windows, one at a time (no two overlap), in turns whose
    order reverses every other window (0 1 | 1 0 | 0 1 for two), so that none always goes first."""
    from benchmarks import rounds

    assert all(isinstance(r, dict) for r in results), results
    assert [rounds.windows_taken(r) for r in results] == [windows] * len(results)
    intervals = sorted((start, end, i) for i, r in enumerate(results)
                       for start, end in r["window_intervals"])
    order = list(range(len(results)))
    assert [i for _, _, i in intervals] == [i for w in range(windows)
                                            for i in (order if w % 2 == 0 else order[::-1])]
    for (_, end, _), (start, _, _) in zip(intervals, intervals[1:]):
        assert end <= start  # one window at a time


def test_json_has_every_section_and_the_environment(quick_run):
    doc = quick_run.doc
    assert doc["mode"] == "quick"
    for section in SECTIONS:
        assert section in doc, section
    env = doc["environment"]
    for key in ("tensorflow", "keras", "cpu_count", "cpu_model", "physical_devices"):
        assert env[key], key
    assert doc["failures"] == []
    strategies = {(e["strategy"], e["devices"]) for e in doc["training"]}
    assert {("one", 1), ("stock", 2), ("ours", 2)} <= strategies
    assert {e["impl"] for e in doc["allreduce"]} == {"stock_default", "stock_rtod", "ours"}
    assert [e["steps_per_execution"] for e in doc["steps_per_execution"]] == [1, 8]
    assert {e["strategy"] for e in doc["multiworker"]} == {"stock", "ours"}


def test_quick_run_groups_take_turns_and_every_window_without_a_deadline(quick_run):
    """Every group of the quick run (the training and batch-norm ones, each window its own `fit`
    call as the training groups run; the all-reduces; the two-worker runs, each pausing both of
    its workers at the same step) times its windows in turns; with no deadline (quick mode has
    none) every process takes all its planned windows, not just the ``min_windows``."""
    kinds = sorted(specs[0]["kind"] for specs, _, _ in quick_run.groups)
    assert kinds == ["allreduce", "multiworker", "train", "train"]
    for specs, deadline, results in quick_run.groups:
        assert deadline is None
        windows = {int(spec["windows"]) for spec in specs}
        assert len(windows) == 1 and len(results) >= 2, specs
        _assert_took_turns(results, windows.pop())
        if specs[0]["kind"] == "train":
            assert all(spec["epoch_per_window"] for spec in specs)
        if specs[0]["kind"] == "multiworker":
            assert [r["replicas"] for r in results] == [2, 2]


def test_figures_are_positive_and_finite(quick_run):
    doc = quick_run.doc
    for section in ("training", "batch_norm", "steps_per_execution", "multiworker"):
        assert doc[section], section
        for entry in doc[section]:
            # Every feature exists now: an unavailable one is a regression.
            assert entry.get("available") is True, (section, entry)
            assert _positive(entry["examples_per_second"]), (section, entry)
            assert _positive(entry["step_ms"]), (section, entry)
    for entry in doc["allreduce"] + [doc["memcopy"]]:
        assert entry["gbps"], entry
        for size, gbps in entry["gbps"].items():
            assert _positive(gbps), (entry, size)
    for entry in doc["allreduce"]:  # 1 MB: 8 all-reduces per call, and also one per call
        assert entry["all_reduces_per_call"] == {"1": 8, "16": 1}, entry
        assert list(entry["gbps_one_per_call"]) == ["1"], entry
        assert _positive(entry["gbps_one_per_call"]["1"]), entry


def test_ours_names_the_all_reduce_inside_its_steps_and_outside(quick_run):
    """Traced once (the default), ours all-reduces in a step with TensorFlow's collective and
    outside steps with its cross_device_ops: the run names both (it once named only the latter)."""
    doc = quick_run.doc
    ours = [e for e in doc["training"] + doc["allreduce"]
            if e.get("strategy", e.get("impl")) == "ours" and e["devices"] > 1]
    assert ours
    for entry in ours:
        assert entry["cross_device_ops"].startswith("CollectiveAllReduce(RING) in steps, "), entry
        assert entry["cross_device_ops"].endswith(" outside them"), entry


def test_table_and_plot_are_written(quick_run):
    out, doc, stdout = quick_run.out, quick_run.doc, quick_run.stdout
    table = (out / "benchmarks.md").read_text()
    assert "Quick-mode numbers" in table  # never mistaken for a real measurement
    assert doc["environment"]["cpu_model"] in table and "ours / stock" in table
    assert "| small CNN | 2 CPU |" in table
    png = (out / "benchmarks.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "targets (quick mode)" in stdout


def test_published_results_are_left_alone(quick_run):
    assert _mtimes() == quick_run.before


def _past_deadline_group(kind):
    """Two processes of ``kind``, 5 windows planned, their deadline passed before they start."""
    if kind == "allreduce":
        return [{"kind": "allreduce", "devices": 2, "sizes_mb": [0.25, 1], "calls_mb": 4,
                 "impl": impl} for impl in ("stock_default", "ours")]
    return [{"kind": "multiworker", "model": "cnn", "global_batch": 32, "timeout": 870,
             "warmup_steps": 2, "window_steps": 2, "strategy": s} for s in ("stock", "ours")]


@pytest.mark.parametrize("kind", ["allreduce", "multiworker"])
def test_a_group_past_its_deadline_stops_every_process_after_the_same_window(kind):
    """Past the deadline a group takes no more windows than ``min_windows`` (3 of 5), in turns,
    one at a time; each kind of worker then ends cleanly (no hang, a result with whole windows
    only). The training kind: the SN-GAN group below. Without a deadline every window is taken:
    the quick run's groups."""
    import time

    from benchmarks import processes

    specs = [dict(spec, windows=5) for spec in _past_deadline_group(kind)]
    results = processes.run_group(specs, timeout=900, deadline=time.perf_counter(), min_windows=3)
    _assert_took_turns(results, 3)
    if kind == "allreduce":
        # Small sizes: several all-reduces of distinct tensors per call (8 MB), and
        # also timed one per call.
        assert all(r["all_reduces_per_call"] == {"0.25": 32, "1": 8} for r in results)
        assert all(len(r[series][mb]["samples"]) == 3 for r in results
                   for series in ("sizes", "one_per_call") for mb in ("0.25", "1"))
    else:  # a multi-worker configuration pauses both of its workers at the same step
        assert [r["replicas"] for r in results] == [2, 2]


def test_round_one_deadlines_leave_the_later_groups_their_time_at_the_pace_so_far(monkeypatch):
    """A group may time windows until the end of the run less what the groups after it
    take, at the pace of those before it; a group cut short is recorded in the JSON
    and named in the table."""
    from benchmarks import plan, rounds, tables

    clock = [1000.0]
    seen = []
    expected = plan.EXPECTED_SECONDS

    def fake_group(specs, timeout, deadline=None, min_windows=1):
        seen.append((deadline - clock[0], min_windows))
        model = specs[0]["model"]
        clock[0] += 2 * expected["cnn/2"] if model == "cnn" else 1.0  # the CNN: twice as slow
        taken = min_windows if model == "resnet50" else specs[0]["windows"]
        return [{"examples_per_second": 1.0, "samples": [1.0] * taken} for _ in specs]

    monkeypatch.setattr(rounds, "run_group", fake_group)
    monkeypatch.setattr(rounds.time, "perf_counter", lambda: clock[0])
    settings = plan.Settings.for_mode(False)
    settings.deadline_seconds = 1000.0
    configs = [plan.Config("training", {"model": m, "strategy": st, "devices": d},
                           plan.train_spec(m, st, d, settings), group=f"{m}/{d}")
               for m, d in (("cnn", 2), ("resnet50", 2), ("resnet50", 4))
               for st in ("stock", "ours")]
    rounds.execute(configs, settings, log=lambda msg: None)
    rest = expected["resnet50/2"] + expected["resnet50/4"]
    assert seen[0] == (1000.0 - rest, 12)  # nothing ran yet: pace 1; half of 24 windows
    # The CNN took twice its time: the next group leaves twice the last one's.
    assert seen[1] == (1000.0 - 2 * expected["cnn/2"] - 2 * expected["resnet50/4"], 6)
    assert seen[2][0] == 1000.0 - 2 * expected["cnn/2"] - 1.0  # the last: all that is left
    assert [c.cut_windows for c in configs[:2]] == [[], []]
    assert configs[2].cut_windows == [{"round": 1, "windows": 6, "planned": 12}]
    doc = {"settings": {"rounds": 1, "resnet_rounds": 1,
                        "deadline_seconds": settings.deadline_seconds,
                        "windows_cut_for_time": [dict(cut, config=c.name)
                                                 for c in configs for cut in c.cut_windows]},
           "environment": {}}
    assert "training/model=resnet50/strategy=stock/devices=2: 6 of 12" in tables.machine_line(doc)


def test_ratios_of_turn_takers_are_paired_window_by_window():
    """Drift that hits both configurations alike cancels in the paired ratio; the
    ratio of medians is used only for configurations that did not take turns."""
    from benchmarks import ratios

    drift = [100.0, 50.0, 100.0, 50.0, 100.0]
    stock = {"examples_per_second": 100.0, "group": "g", "window_samples": [drift]}
    ours = {"examples_per_second": 55.0, "group": "g",
            "window_samples": [[x * 1.1 for x in drift]]}
    assert ratios.speedup(ours, stock) == pytest.approx(1.1)
    alone = dict(ours, group=None)
    assert ratios.speedup(alone, stock) == pytest.approx(0.55)
    uneven = dict(ours, window_samples=[[55.0, 110.0]])
    assert ratios.speedup(uneven, stock) == pytest.approx(0.55)
    assert ratios.speedup(None, stock) is None


def test_throughput_target_takes_ours_at_its_best_and_shows_both_at_the_same_settings():
    """Stock cannot run steps_per_execution > 1 on 2+ replicas: the target compares it
    with ours at its best, and the same-settings ratio is reported beside it."""
    from benchmarks import targets

    def entry(eps, **key):
        return dict(key, available=True, examples_per_second=eps, group="g",
                    window_samples=[[eps] * 3], step_ms=1.0)

    doc = {"training": [entry(100.0, model="cnn", strategy="stock", devices=2),
                        entry(98.0, model="cnn", strategy="ours", devices=2),
                        entry(50.0, model="resnet50", strategy="stock", devices=2),
                        entry(52.0, model="resnet50", strategy="ours", devices=2)],
           "steps_per_execution": [entry(98.0, model="cnn", devices=2, steps_per_execution=1),
                                   entry(107.0, model="cnn", devices=2, steps_per_execution=8)],
           "batch_norm": [], "allreduce": []}
    (target, measured, met), = targets.targets(doc)
    assert met == "yes" and "1.040x at worst (ResNet-50 (32x32), 2 CPU" in measured
    assert "Both at `steps_per_execution=1`: 0.980x at worst (small CNN, 2 CPU)" in measured
    doc["training"][3] = entry(49.0, model="resnet50", strategy="ours", devices=2)
    assert targets.targets(doc)[0][2] == "no"  # a row without spe=8 counts at 1


def test_median_interval_is_the_distribution_free_one():
    """For 12 values the 90% interval is the 3rd smallest to the 3rd largest
    (coverage 1 - 2 * P(Binomial(12, 1/2) <= 2) = 0.961; the 4th would give 0.854)."""
    from benchmarks import ratios

    values = [float(v) for v in (7, 3, 11, 1, 9, 5, 12, 2, 8, 4, 10, 6)]
    assert ratios.median_interval(values) == (3.0, 10.0)
    assert ratios.median_interval([1.0, 2.0, 3.0]) is None  # too few for 90%
    assert ratios.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) == (1.0, 5.0)  # 1 - 2/32


def _bn_entry(model, bn, samples, group):
    return {"model": model, "batch_norm": bn, "devices": 4, "available": True, "group": group,
            "examples_per_second": sorted(samples)[len(samples) // 2],
            "step_ms": 1000.0 / sorted(samples)[len(samples) // 2], "window_samples": [samples]}


@pytest.mark.parametrize("layers_ratio, whole_ratio, met, verdict", [
    (0.9, 1.03, "yes", "within what the run resolves"),  # whole model: noise both ways
    (0.9, 1.25, "no", "slower"),  # whole model resolved slower
    (1.05, 0.95, "no", "within what the run resolves"),  # the layers themselves slower
])
def test_batch_norm_target_is_decided_where_the_layers_make_the_step(
        layers_ratio, whole_ratio, met, verdict):
    """Where batch norm makes most of a step the median decides; in the whole ResNet-50
    (a tenth of a step) only a resolved slowdown fails the target."""
    from benchmarks import targets

    drift = [1.0, 0.8, 1.2, 0.9, 1.1, 0.85, 1.15, 0.95, 1.05, 1.0, 0.9, 1.1]
    sync = [100.0 * d for d in drift]  # cancels in the paired ratios
    # Window-to-window noise of the paired ratio: none in the layers' comparison,
    # +-10% in the whole model's, whose 90% interval is then about 0.9-1.1 times it.
    noise = {"cnn_bn": [1.0] * 12, "resnet50": [1.0, 0.92, 1.08, 0.95, 1.05, 0.9, 1.1, 0.97,
                                                 1.03, 1.0, 0.93, 1.07]}
    doc = {"batch_norm": []}
    for model, ratio in (("cnn_bn", layers_ratio), ("resnet50", whole_ratio)):
        # Step time `ratio` times sync's: throughput 1/ratio of it, window by window.
        glob = [x / ratio * n for x, n in zip(sync, noise[model])]
        doc["batch_norm"] += [_bn_entry(model, "keras_sync", sync, model),
                              _bn_entry(model, "global", glob, model)]
    ((target, measured, verdict_met),) = targets.batch_norm_target(doc)
    assert verdict_met == met, measured
    assert "whole ResNet-50 (32x32): " in measured and verdict in measured
    assert measured.startswith(f"{layers_ratio:.3f}x at worst (CNN + BN")


def test_whole_model_batch_norm_without_paired_windows_reads_cleanly():
    """Entries that did not take turns have no interval: the verdict stands alone."""
    from benchmarks import targets

    doc = {"batch_norm": [_bn_entry("resnet50", "keras_sync", [100.0] * 12, None),
                          _bn_entry("resnet50", "global", [110.0] * 12, None)]}
    ((_, measured, met),) = targets.batch_norm_target(doc)
    assert measured == "whole ResNet-50 (32x32): 0.91x (within what the run resolves)"
    assert met == "yes"


def test_all_reduce_target_reads_several_per_call_and_shows_one_per_call():
    """The target is decided on the all-reduce's bandwidth (several per call); the
    figure one per call, where it differs, is shown beside it in the target and table."""
    from benchmarks import tables, targets

    def entry(impl, gbps, one):
        return {"impl": impl, "devices": 2, "available": True, "group": "ar",
                "all_reduces_per_call": {"1": 8, "16": 1},
                "gbps": {"1": gbps, "16": 10 * gbps}, "gbps_one_per_call": {"1": one},
                "window_samples": {"1": [[gbps] * 4], "16": [[10 * gbps] * 4]},
                "window_samples_one_per_call": {"1": [[one] * 4]}}

    doc = {"training": [], "batch_norm": [], "steps_per_execution": [],
           "allreduce": [entry("stock_default", 2.0, 1.5), entry("ours", 9.0, 2.7)],
           "memcopy": {"gbps": {"1": 40.0, "16": 30.0}}}
    ((target, measured, met),) = targets.targets(doc)
    assert met == "yes" and measured.startswith("4.500x at worst (1 MB, 2 CPU")
    assert "One all-reduce per call" in measured and "1.80x at worst (1 MB, 2 CPU" in measured
    table = "\n".join(tables.bandwidth_table(doc))
    assert "| 2 CPU | 1 MB | 8 | 2.00 |" in table and "**4.50x** | **1.80x** |" in table
    assert "| 2 CPU | 16 MB | 1 | 20.00 |" in table and "**4.50x** | - |" in table
    doc["allreduce"][1] = entry("ours", 3.0, 2.7)
    assert targets.targets(doc)[0][2] == "no"  # 1.5x with several per call


def test_the_sngan_group_is_one_device_stock_and_ours_on_the_largest_device_count():
    """The default full run has an SN-GAN group on 4 devices only (one device, stock, ours
    and the replica-work reference taking turns), its global batch that of the SN-GAN learning check."""
    from benchmarks import plan

    settings = plan.Settings.for_mode(False)
    assert "sngan" in settings.models
    configs = [c for c in plan.plan(settings, {"global_batch_norm_available": True})
               if c.key.get("model") == "sngan"]
    assert [(c.section, c.key["strategy"], c.key["devices"], c.group) for c in configs] == [
        ("training", "one", 1, "sngan/4"), ("training", "stock", 4, "sngan/4"),
        ("training", "ours", 4, "sngan/4"), ("training", "reference", 4, "sngan/4")]
    assert all(c.spec["global_batch"] == 32 and c.spec["epoch_per_window"] for c in configs)
    assert "sngan/4" in plan.EXPECTED_SECONDS


def test_sngan_worker_times_generator_updates_taking_turns_and_stops_past_its_deadline():
    """The SN-GAN's `fit` runs in the benchmark worker on one device and on 2 replicas (ours),
    the two timing their windows in turns, one at a time. Past the deadline (the training kind's
    case of the test above) both stop after the same window, 3 of 5: within one `fit` call (one
    device) and between `fit` calls, each window its own (ours), as the training groups run."""
    import time

    from benchmarks import processes

    spec = {"kind": "train", "model": "sngan", "global_batch": 8, "steps_per_execution": 1,
            "warmup_steps": 1, "windows": 5, "window_steps": 1}
    specs = [dict(spec, strategy="one", devices=1, epoch_per_window=False),
             dict(spec, strategy="ours", devices=2, epoch_per_window=True)]
    results = processes.run_group(specs, timeout=900, deadline=time.perf_counter(), min_windows=3)
    _assert_took_turns(results, 3)
    assert [r["replicas"] for r in results] == [1, 2]
    assert results[0]["parameters"] == results[1]["parameters"] > 100_000
    assert all(_positive(x) for r in results for x in r["samples"])


def test_sngan_table_gives_step_times_and_says_how_stock_fails():
    """The GAN row: ms per generator update and paired ratios; a stock failure is shown
    in the row (its exception's line) and is not a failure of the run."""
    from benchmarks import plan, results, tables, targets

    def entry(strategy, devices, ms):
        samples = [1000.0 * 32 / x for x in ms]
        return {"model": "sngan", "strategy": strategy, "devices": devices, "available": True,
                "group": "sngan/4", "global_batch": 32, "window_samples": [samples],
                "examples_per_second": sorted(samples)[1], "step_ms": sorted(ms)[1]}

    doc = {"training": [entry("one", 1, [100.0, 120.0, 110.0]),
                        entry("stock", 4, [400.0, 300.0, 350.0]),
                        entry("ours", 4, [200.0, 150.0, 175.0]),
                        # the replica-work reference: one device doing the 4 replicas' work
                        entry("reference", 4, [160.0, 150.0, 155.0])]}
    table = "\n".join(tables.gan_table(doc))
    # ours / reference, paired by window: median of 160/200, 150/150, 155/175 = 0.886
    assert ("| SN-GAN (16x16) | 4 CPU | 110.0 ms | 350.0 ms | 175.0 ms | 155.0 ms | **0.63x** "
            "| **2.00x** | **0.89x** |") in table
    assert targets.targets(dict(doc, batch_norm=[], allreduce=[], steps_per_execution=[])) == []
    error = ("exit 1:\nTraceback (most recent call last):\n  ...\n"
             "tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error")
    doc["training"][1] = {"model": "sngan", "strategy": "stock", "devices": 4,
                          "available": False, "error": error}
    table = "\n".join(tables.gan_table(doc))
    assert "| fails: `tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph " \
           "execution error` | 175.0 ms | 155.0 ms | **0.63x** | - | **0.89x** |" in table
    failed = plan.Config("training", {"model": "sngan", "strategy": "stock", "devices": 4},
                         {"global_batch": 32}, errors=[error])
    crashed = plan.Config("training", {"model": "cnn", "strategy": "stock", "devices": 4},
                          {"global_batch": 128}, errors=[error])
    settings = plan.Settings.for_mode(False)
    collected = results.collect([failed, crashed], settings, {}, 0.0, 1.0)
    assert [f["config"] for f in collected["failures"]] == [crashed.name]
    assert collected["training"][0]["error"] == error


def test_xla_group_pairs_xla_on_and_off_and_shows_how_stock_fails():
    """The full run has one XLA group on the largest device count: one device and ours with
    `jit_compile` off and on, and stock with it on; the table pairs on/off, shows stock's
    TensorFlow message, and stock's failure is not a failure of the run."""
    from benchmarks import plan, results, xla_table

    configs = [c for c in plan.plan(plan.Settings.for_mode(False), {}) if c.section == "xla"]
    assert [(c.key["strategy"], c.key["devices"], c.key["jit"], c.spec["jit_compile"], c.group)
            for c in configs] == [("one", 1, False, False, "xla/4"), ("one", 1, True, True, "xla/4"),
                                  ("ours", 4, False, False, "xla/4"), ("ours", 4, True, True, "xla/4"),
                                  ("stock", 4, True, True, "xla/4")]
    assert not [c for c in plan.plan(plan.Settings.for_mode(True), {}) if c.section == "xla"]

    def entry(strategy, devices, jit, ms):
        samples = [1000.0 * 128 / x for x in ms]
        return {"model": "cnn", "strategy": strategy, "devices": devices, "jit": jit,
                "available": True, "group": "xla/4", "window_samples": [samples],
                "examples_per_second": sorted(samples)[1], "step_ms": sorted(ms)[1]}

    error = ("exit 1:\nTraceback (most recent call last):\n"
             "Trying to access resource conv2d/kernel/replica_1/5 located in device CPU:1\n"
             " Cf. https://www.tensorflow.org/xla/known_issues\n\t [[{{node StatefulPartitionedCall}}]]")
    doc = {"xla": [entry("one", 1, False, [100.0, 100.0, 100.0]),
                   entry("one", 1, True, [50.0, 50.0, 50.0]),
                   entry("ours", 4, False, [200.0, 200.0, 200.0]),
                   entry("ours", 4, True, [400.0, 400.0, 400.0]),
                   {"model": "cnn", "strategy": "stock", "devices": 4, "jit": True,
                    "available": False, "error": error}]}
    table = "\n".join(xla_table.xla_table(doc))
    assert "| one device | 1 CPU | 100.0 ms | 50.0 ms | **2.00x** |" in table
    assert "| `ReplicatorStrategy` | 4 CPU | 200.0 ms | 400.0 ms | **0.50x** |" in table
    assert ("| stock `MirroredStrategy` | 4 CPU | not measured | fails: `Trying to access resource "
            "conv2d/kernel/replica_1/5 located in device CPU:1` | - |") in table
    stock = plan.Config("xla", {"model": "cnn", "strategy": "stock", "devices": 4, "jit": True},
                        {"global_batch": 128}, errors=[error])
    assert results.collect([stock], plan.Settings.for_mode(False), {}, 0.0, 1.0)["failures"] == []


@pytest.fixture(scope="module")
def peers_run(tmp_path_factory):
    """The peers section at tiny sizes, one round; no JAX interpreter (the suite makes no venv)."""
    out = tmp_path_factory.mktemp("peers")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KR_TEST_DEVICES", None)
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--size", "tiny", "--rounds", "1",
         "--devices", "1", "2", "--epochs", "1", "--workloads", "cnn", "lm_mp",
         "--jax-python", str(out / "no-jax-venv" / "python"), "--output-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out / "peers.json") as f:
        doc = json.load(f)
    with open(out / "peers.md") as f:
        table = f.read()
    return doc, table


def test_peers_section_runs_ours_and_stock_and_writes_its_table(peers_run):
    doc, table = peers_run
    rows = {(r["workload"], r["devices"], r["stack"]): r for r in doc["summary"]}
    assert set(rows) == {("cnn", 1, "ours"), ("cnn", 1, "stock"), ("cnn", 2, "ours"),
                         ("cnn", 2, "stock"), ("lm_mp", 2, "ours")}
    for row in rows.values():
        assert row["runs"] == 1 and not row["errors"], row
        assert _positive(row["first_step_s"]) and _positive(row["steady_examples_per_s"])
    for stack in ("ours", "stock"):  # each stack at 2 devices against its own at 1
        assert math.isfinite(rows[("cnn", 2, stack)]["weights_max_difference"])
    assert "jax: skipped, no JAX venv" in table and "jax" in doc["skipped"]
    # The oneDNN setting the TensorFlow stacks inherited (conftest sets 1 unless the caller set
    # it), and what ours' runs found.
    setting = os.environ["TF_ENABLE_ONEDNN_OPTS"]
    on = setting.lower() in ("1", "true")  # as TensorFlow reads a boolean environment variable
    assert f"TensorFlow's stacks: TF_ENABLE_ONEDNN_OPTS={setting}; oneDNN {'on' if on else 'off'} in ours' runs." in table
    assert all(r["onednn"] is on for r in doc["records"] if r["stack"] == "ours")
    assert table.count("\n| cnn |") == 2 and "\n| lm_mp | 2 |" in table


def test_peers_rounds_alternate_the_stacks():
    from benchmarks.peers import runs_of_round

    orders = [[r["stack"] for r in runs_of_round(i, ["ours", "stock", "jax"], ["cnn"], [4])]
              for i in range(3)]
    assert orders == [["ours", "stock", "jax"], ["stock", "jax", "ours"], ["jax", "ours", "stock"]]
    model_parallel = runs_of_round(0, ["ours", "stock", "jax"], ["lm_mp"], [1, 2])
    assert [(r["stack"], r["devices"]) for r in model_parallel] == [("ours", 2), ("jax", 2)]


def _steady_result(model, devices, default, per_replica, one):
    windows = {"one": [one] * 3, "default": [default] * 3, "per_replica": [per_replica] * 3}
    return {"devices": devices, "model": model, "steps": 3, "load_average": [1.0, 1.5, 2.0],
            "median_s_per_step": {k: v[0] for k, v in windows.items()},
            "speed_default_over_per_replica": per_replica / default,
            "speed_default_over_one_device": one / default,
            "steady_s_per_step": {k: v[0] for k, v in windows.items()},
            "steady_speed_default_over_per_replica": per_replica / default,
            "steady_speed_default_over_one_device": one / default,
            "windows_s_per_step": windows, "windows_steady_s_per_step": windows}


def test_engine_steady_records_one_row_per_model_and_device_count(tmp_path):
    """A new measurement of a (model, devices) replaces its row; the others stay, in order."""
    from benchmarks.engine_steady import record

    record(_steady_result("resnet50", 4, 2.0, 1.0, 4.0), str(tmp_path))
    record(_steady_result("cnn", 8, 0.5, 0.4, 0.2), str(tmp_path))
    _, md_path = record(_steady_result("resnet50", 4, 1.0, 1.5, 3.0), str(tmp_path))
    with open(tmp_path / "engine_steady.json") as f:
        rows = json.load(f)["rows"]
    assert [(r["model"], r["devices"]) for r in rows] == [("cnn", 8), ("resnet50", 4)]
    with open(md_path) as f:
        lines = [line for line in f.read().splitlines() if line.startswith("| ")]
    assert len(lines) == 3  # the header and two rows
    # resnet50 at 4: steady 3.000 / 1.000 / 1.500; default 1.50x trace_once=False, 3.00x one device
    # A row from before the replica-work reference joined: "-" in its columns.
    assert lines[2].startswith("| resnet50 | 64 | 4 | 3 x 3 | 3.000 | 1.000 | 1.500 | - | **1.50x** | **3.00x** "
                               "| 2.00x | - | - |")
    assert lines[1].startswith("| cnn | 128 | 8 | 3 x 3 | 0.200 | 0.500 | 0.400 | - | **0.80x** | **0.40x** "
                               "| 0.50x | - | - |")
    # Whether oneDNN's kernels ran, as the measuring process found; a row from before: not recorded.
    assert "| 0.80x | not recorded | 1.0, 1.5, 2.0 |" in lines[1]
    record(dict(_steady_result("cnn", 8, 0.5, 0.4, 0.2), onednn=True), str(tmp_path))
    with open(md_path) as f:
        assert "| 0.80x | on | 1.0, 1.5, 2.0 |" in f.read()


def test_engine_steady_reports_the_replica_work_reference(tmp_path):
    """With the reference measured: its s/step, default / reference and reference / one device, paired."""
    from benchmarks.engine_steady import record

    result = _steady_result("resnet50v2", 4, 1.2, 1.0, 0.6)
    result["global_batch"] = 128
    result["steady_s_per_step"]["reference"] = 1.0
    result["windows_steady_s_per_step"]["reference"] = [1.0] * 3
    result["steady_speed_default_over_reference"] = 1.0 / 1.2
    result["steady_speed_reference_over_one_device"] = 0.6
    _, md_path = record(result, str(tmp_path))
    with open(md_path) as f:
        row = [line for line in f.read().splitlines() if line.startswith("| resnet50v2")][0]
    assert row.startswith("| resnet50v2 | 128 | 4 | 3 x 3 | 0.600 | 1.200 | 1.000 | 1.000 | **0.83x** | **0.50x** "
                          "| 0.60x | **0.83x** | 0.60x |")


def test_d4pg_pendulum_runs_refuse_a_missing_output_folder_before_the_first_run(tmp_path, monkeypatch):
    """Five runs take half an hour: a folder that is not there is said before the first starts."""
    from benchmarks import d4pg

    started = []
    monkeypatch.setattr(d4pg, "pendulum_run", lambda *a, **k: started.append(a))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        d4pg.pendulum_runs([0], str(tmp_path / "absent" / "runs.json"))
    assert started == []


def test_onednn_runs_each_setting_in_its_own_process_and_writes_its_table(tmp_path):
    """`python -m benchmarks.onednn`: the machine's default, then oneDNN off and on, each reported
    as TensorFlow ran it (tiny: one call of each, the small CNN on 2 devices)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.onednn", "--steps", "1", "--devices", "2",
                           "--model", "cnn", "--output-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "onednn.json") as f:
        doc = json.load(f)
    by = {r["setting"]: r for r in doc["results"]}
    assert (by["0"]["onednn"], by["1"]["onednn"]) == (False, True)
    assert set(by["0"]["seconds"]) == set(by["1"]["seconds"]) == set(by["default"]["seconds"])
    assert len(by["0"]["seconds"]) == 8  # 2 convolutions x 3 kernels, 2 fit steps
    assert all(s > 0 for r in doc["results"] for s in r["seconds"].values())
    with open(tmp_path / "onednn.md") as f:
        rows = [line for line in f.read().splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 8 and "small CNN fit step, ReplicatorStrategy on 2 devices" in rows[-1]


def test_first_step_rounds_rotate_and_report_the_median_round():
    """`first_step --rounds`: each round starts one configuration later; a row is the round with
    the median first step (its phases that round's, so they add up), every round's beside it."""
    from benchmarks.first_step import markdown, median_round, rotated

    runs = ["a", "b", "c"]
    assert [rotated(runs, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                    ["a", "b", "c"]]
    phases = {"prepare": 1.0, "grappler": 1.0, "step": 0.5, "nodes": 100}

    def run(strategy, replicas, first_step):
        return dict(phases, model="sngan", strategy=strategy, replicas=replicas, first_step=first_step,
                    trace=first_step - 3.0, first_call=2.0)

    ones = [run("one", 1, t) for t in (9.0, 5.0, 7.0)]
    chosen = median_round(ones)
    assert chosen["first_step"] == 7.0 and chosen["trace"] == 4.0
    assert chosen["first_step_rounds"] == [9.0, 5.0, 7.0]
    failed = median_round([run("ours", 4, 14.0), {"model": "sngan", "strategy": "ours", "replicas": 4,
                                                   "error": "exit 1"}])
    assert failed["first_step"] == 14.0 and failed["failed_rounds"] == 1
    doc = {"date": "d", "environment": "e", "models": ["sngan"], "rounds": 3,
           "results": [chosen, median_round([run("ours", 4, t) for t in (10.5, 14.0, 12.0)])]}
    table = markdown(doc)
    assert "3 rounds" in table
    assert "| sngan | ours, traced once | 4 | 1.0 | 9.0 | 2.0 | 1.0 | **12.0** | 1.71x |" in table
    assert table.count("| 10.5, 14.0, 12.0 |") == 1 and "| 9.0, 5.0, 7.0 |" in table
    assert "- sngan, first step on 4 replicas <= 1.5x one device's: 1.71x (not met)" in table


def test_first_step_times_the_trace_made_by_the_train_functions_first_call():
    """The harness lets the train function's first call trace it, as `fit` does: our wrapper of that
    call then gives Keras's train function (the calls of the step traced once) the lean passes.
    A trace made before the call (`get_concrete_function`) left it every pass, twice."""
    from benchmarks.first_step import measure

    result = measure("cnn", "ours", 2, timeout=300)
    assert "error" not in result, result.get("error")
    assert result["train_function_passes"] == ["common_subgraph_elimination", "dependency_optimizer",
                                               "model_pruner"]
    assert 0 < result["trace"] < result["trace"] + result["first_call"] <= result["first_step"]


def test_replica_work_times_the_peers_lm_with_its_adamw():
    from benchmarks.replica_work import GLOBAL_BATCH, step_seconds

    assert GLOBAL_BATCH["lm"] == 32  # the peers' LM batch
    assert step_seconds("lm", 8, repeats=1) > 0
