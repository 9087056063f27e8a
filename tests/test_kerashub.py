"""KerasHub fine-tuning under ReplicatorStrategy: 4 replicas train as one device does.

Every model is built from a config (tests/hub_models.py: 2 layers, hidden 16, local
text, tokenizers made here, no download). KerasHub's preprocessors emit a bool
``padding_mask`` (causal LMs also a bool ``sample_weight``), which stock
``MirroredStrategy`` cannot reduce when Keras builds the model from the first batch
("Value for attr 'T' of bool is not in the list of allowed values ... AddN").

Also here: the ```python blocks of docs/kerashub.md (run as written, in this process),
keras-io's data-parallel KerasHub example (examples/kerashub_data_parallel.py, in a
fresh interpreter) and the GPT-2 causal LM on 2 workers (tests/hub_job.py).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import keras
import keras_hub
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator import launch as launcher
from tests import hub_models as hub
from tests.helpers import ROOT, launch_env, python_blocks

TOLERANCE = 1e-5  # on every loss and every weight, against one device


@pytest.fixture(scope="module")
def bert_tokenizer():
    return hub.bert_tokenizer()


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    return hub.gpt2_tokenizer()


@pytest.fixture(scope="module")
def gemma_proto():
    return hub.gemma_proto()


def fit(model, fit_args: dict, preprocessed: bool = False) -> list[float]:
    """The losses of ``model.fit(**fit_args)``; ``preprocessed``: the data are the preprocessor's
    output, so the task's preprocessor is set aside for ``fit`` (KerasHub's way to turn it off)."""
    preprocessor = model.preprocessor
    if preprocessed:
        model.preprocessor = None
    try:
        return model.fit(**fit_args, **hub.FIT).history["loss"]
    finally:
        model.preprocessor = preprocessor


def train_both(build, fit_args: dict, preprocessed: bool = False):
    """``build()`` (it compiles) on one device and in a 4-replica strategy's scope, each fitted
    with ``fit_args``: (one-device model, its losses, replicated model, its losses)."""
    reference = build()
    hub.build_optimizer_slots(reference)
    reference_losses = fit(reference, fit_args, preprocessed)
    strategy = kr.ReplicatorStrategy()
    assert strategy.num_replicas_in_sync == 4
    with strategy.scope():
        replicated = build()
    return reference, reference_losses, replicated, fit(replicated, fit_args, preprocessed)


def assert_trained_as_one_device(reference, reference_losses, replicated, losses, what: str) -> None:
    kr.testing.assert_replicas_identical(replicated)
    loss_gap = float(np.max(np.abs(np.subtract(losses, reference_losses))))
    weight_gap = kr.testing.max_weight_difference(replicated, reference)
    print(f"{what}: losses {losses}; against one device: losses {loss_gap:.2e}, weights {weight_gap:.2e}")
    assert loss_gap <= TOLERANCE, (losses, reference_losses)
    assert weight_gap <= TOLERANCE
    assert losses[-1] < losses[0]  # it learns


@pytest.mark.core
def test_bert_classifier_from_strings(bert_tokenizer):
    def build():
        model = hub.bert_classifier(bert_tokenizer)
        model.compile(keras.optimizers.Adam(1e-2),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    reference, reference_losses, replicated, losses = train_both(
        build, dict(x=hub.TEXT, y=np.array(hub.LABELS)))
    assert_trained_as_one_device(reference, reference_losses, replicated, losses, "BERT classifier")


@pytest.fixture(scope="module")
def gpt2_one_device(gpt2_tokenizer):
    """The one-device reference of the GPT-2 tests (and of the 2-worker job)."""
    model = hub.gpt2_causal_lm(gpt2_tokenizer)
    hub.compile_causal_lm(model)
    hub.build_optimizer_slots(model)
    return model, model.fit(hub.TEXT, **hub.FIT).history["loss"]


def generated(model) -> list[str]:
    # stop_token_ids=None: every prompt runs to max_length, no early stop hides a difference.
    return list(model.generate(hub.PROMPTS, max_length=hub.SEQUENCE_LENGTH, stop_token_ids=None))


def test_gpt2_causal_lm_generate_save_and_reload(gpt2_tokenizer, gpt2_one_device, tmp_path):
    reference, reference_losses = gpt2_one_device
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        model = hub.gpt2_causal_lm(gpt2_tokenizer)
        hub.compile_causal_lm(model)
    losses = model.fit(hub.TEXT, **hub.FIT).history["loss"]
    assert_trained_as_one_device(reference, reference_losses, model, losses, "GPT-2 causal LM")

    outputs = generated(model)
    assert outputs == generated(reference)
    assert all(o.startswith(p) and len(o) > len(p) for o, p in zip(outputs, hub.PROMPTS)), outputs

    path = str(tmp_path / "gpt2.keras")
    assert kr.save_model(model, path)
    loaded = keras.saving.load_model(path)
    assert kr.testing.max_weight_difference(loaded, model) == 0.0
    loaded.compile(sampler="greedy")
    assert generated(loaded) == outputs


def test_gpt2_causal_lm_with_lora_and_adamw_also_with_sharded_optimizer_state(gpt2_tokenizer):
    def build():
        model = hub.gpt2_causal_lm(gpt2_tokenizer, lora_rank=2)
        hub.compile_causal_lm(model, optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.01))
        return model

    reference, reference_losses, replicated, losses = train_both(build, dict(x=hub.TEXT))
    trainable = {w.path for w in replicated.trainable_weights}
    assert any("lora_kernel" in p for p in trainable)
    assert len(trainable) < len(replicated.weights)  # the attention kernels are frozen
    assert_trained_as_one_device(reference, reference_losses, replicated, losses, "GPT-2 causal LM, LoRA rank 2")

    # The same fine-tuning with AdamW's moments sharded over the 4 replicas: the same weights.
    with kr.ReplicatorStrategy(shard_optimizer_state=True).scope():
        sharded = build()
    sharded_losses = fit(sharded, dict(x=hub.TEXT))
    kr.testing.assert_replicas_identical(sharded)
    gap = kr.testing.max_weight_difference(sharded, replicated)
    print(f"GPT-2 LoRA, AdamW sharded over 4 replicas: weights against unsharded {gap:.2e}")
    assert gap <= 1e-6 and np.max(np.abs(np.subtract(sharded_losses, losses))) <= 1e-6
    held = kr.optimizers.state_bytes_per_device(sharded.optimizer)
    whole = kr.optimizers.state_bytes_per_device(replicated.optimizer)
    assert len(held) == 4 and max(held.values()) < max(whole.values()) / 2


def test_gemma_causal_lm_with_a_local_sentencepiece_proto(gemma_proto):
    def build():
        model = hub.gemma_causal_lm(gemma_proto)
        hub.compile_causal_lm(model)
        return model

    # Tokenized before fit: KerasHub 0.32's SentencePiece tokenizer creates its TensorFlow Text
    # resource lazily, inside fit's tf.data map, where the next op does not find it ("Resource
    # localhost/_0_SentencepieceOp/... does not exist"), on one device without any strategy too.
    tokenizer = keras_hub.models.GemmaTokenizer(proto=gemma_proto)
    x, y, sample_weight = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, hub.SEQUENCE_LENGTH)(hub.TEXT)
    assert x["padding_mask"].dtype == "bool" and sample_weight.dtype == "bool"
    reference, reference_losses, replicated, losses = train_both(
        build, dict(x=x, y=y, sample_weight=sample_weight), preprocessed=True)
    assert_trained_as_one_device(reference, reference_losses, replicated, losses, "Gemma causal LM")
    assert generated(replicated) == generated(reference)


def test_masked_lm_keras_io_recipe(bert_tokenizer):
    # keras-io's data-parallel KerasHub recipe (BertMaskedLM, AdamW, weighted accuracy, the
    # pooler frozen), fed the same masked batches on both sides: the masking is random.
    x, y, sample_weight = hub.masked_batches(bert_tokenizer)
    assert x["padding_mask"].dtype == bool
    reference, reference_losses, replicated, losses = train_both(
        lambda: hub.masked_lm(bert_tokenizer), dict(x=x, y=y, sample_weight=sample_weight))
    assert_trained_as_one_device(reference, reference_losses, replicated, losses, "BERT masked LM")


def test_masked_lm_fed_from_a_generator_counts_its_steps_as_one_device(bert_tokenizer):
    # The same recipe fed from a generator (unknown cardinality), AdamW, 3 epochs, the step
    # traced once (the default). One device reads each epoch's last step from an exhausted
    # iterator and still increments `iterations` (an inlined call runs what needs no input);
    # AdamW's bias correction reads it, so a step that did not count drifted (1.9e-4).
    import tensorflow as tf

    x, y, sample_weight = hub.masked_batches(bert_tokenizer)
    batch = 8

    def dataset():
        def batches():
            for i in range(0, len(y), batch):
                yield {k: v[i:i + batch] for k, v in x.items()}, y[i:i + batch], sample_weight[i:i + batch]

        def spec(v):
            return tf.TensorSpec([None, *v.shape[1:]], tf.as_dtype(v.dtype))

        return tf.data.Dataset.from_generator(
            batches, output_signature=({k: spec(v) for k, v in x.items()}, spec(y), spec(sample_weight)))

    fit_args = dict(epochs=3, verbose=0)
    reference = hub.masked_lm(bert_tokenizer)
    hub.build_optimizer_slots(reference)
    reference.fit(dataset(), **fit_args)
    strategy = kr.ReplicatorStrategy()
    with strategy.scope():
        replicated = hub.masked_lm(bert_tokenizer)
    losses = replicated.fit(dataset(), **fit_args).history["loss"]
    steps = 3 * len(range(0, len(y), batch))
    assert int(reference.optimizer.iterations.numpy()) == steps + 3  # what is reproduced
    assert int(replicated.optimizer.iterations.numpy()) == steps + 3
    kr.testing.assert_replicas_identical(replicated)
    gap = kr.testing.max_weight_difference(replicated, reference)
    print(f"BERT masked LM from a generator, traced once: weights against one device {gap:.2e}")
    # The file's tolerance, not 1e-6: the step traced once sums gradients in TensorFlow's ring,
    # in another order than one device, and AdamW's normalised steps carry that over 3 epochs.
    # Measured on 4 draws of the random masks: 1.5e-7 to 1.2e-6 (1.5e-7 for the same batches
    # fed with a known length in the same process); 1.9e-4 without the exhausted step's effects.
    assert gap <= TOLERANCE
    assert losses[-1] < losses[0]


def run_guide_example(index: int, tmp_path, monkeypatch) -> dict:
    """Runs ```python block ``index`` of docs/kerashub.md as written, in this process (it asks for
    the 4 devices this process has) and in ``tmp_path``; returns its variables."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(python_blocks("docs/kerashub.md")[index], f"docs/kerashub.md block {index}", "exec"), namespace)
    return namespace


def test_guide_classifier_example(tmp_path, monkeypatch):
    example = run_guide_example(0, tmp_path, monkeypatch)
    classifier, history = example["classifier"], example["history"].history
    assert example["strategy"].num_replicas_in_sync == 4
    kr.testing.assert_replicas_identical(classifier)
    assert history["loss"][-1] < history["loss"][0]


def test_guide_causal_lm_with_lora_in_mixed_bfloat16_example(tmp_path, monkeypatch):
    example = run_guide_example(1, tmp_path, monkeypatch)
    lm, reloaded, losses = example["lm"], example["reloaded"], example["history"].history["loss"]
    assert lm.backbone.compute_dtype == "bfloat16" and {w.dtype for w in lm.weights} == {"float32"}
    assert any("lora_kernel" in w.path for w in lm.trainable_weights)
    kr.testing.assert_replicas_identical(lm)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert reloaded.backbone.compute_dtype == "bfloat16"
    # Keras saves a LoRA layer's kernel with its adapters merged in (on one device too).
    assert not any("lora" in w.path for w in reloaded.weights)
    prompts = ["the cat", "a dog"]
    assert list(reloaded.generate(prompts, max_length=20, stop_token_ids=None)) == list(
        lm.generate(prompts, max_length=20, stop_token_ids=None))


def test_causal_lm_on_two_workers(gpt2_one_device, tmp_path):
    env = launch_env()
    out = io.StringIO()
    code = launcher.launch(os.path.join(ROOT, "tests", "hub_job.py"), [str(tmp_path)], workers=2,
                           devices_per_worker=1, env=env, timeout=400, output=out)
    assert code == 0, out.getvalue()[-8000:]
    reference, reference_losses = gpt2_one_device
    workers = []
    for i in range(2):
        with open(tmp_path / f"worker{i}.json") as f:
            report = json.load(f)
        with np.load(tmp_path / f"worker{i}.npz") as arrays:
            weights = [arrays[f"arr_{k}"] for k in range(len(arrays.files))]
        assert report["worker_index"] == i and report["num_replicas"] == 2
        workers.append((report, weights))
    (chief, chief_weights), (other, other_weights) = workers
    assert chief["loss"] == other["loss"]
    for a, b in zip(chief_weights, other_weights):
        np.testing.assert_array_equal(a, b)
    loss_gap = float(np.max(np.abs(np.subtract(chief["loss"], reference_losses))))
    weight_gap = max(float(np.max(np.abs(a - b))) for a, b in zip(chief_weights, reference.get_weights()))
    print(f"GPT-2 causal LM on 2 workers: against one device: losses {loss_gap:.2e}, weights {weight_gap:.2e}")
    assert loss_gap <= TOLERANCE and weight_gap <= TOLERANCE


def test_keras_io_data_parallel_example_runs(tmp_path):
    """examples/kerashub_data_parallel.py: keras-io's recipe, on local text, under ours."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KR_TEST_DEVICES", None)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "kerashub_data_parallel.py"), "--write-sample-text",
         str(tmp_path / "text")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Number of devices: 4" in result.stdout
    for epoch in (1, 2, 3):  # its PrintLR callback, after each epoch
        assert f"Learning rate for epoch {epoch} is" in result.stdout
    assert "val_loss" in result.stdout
    assert os.listdir(tmp_path / "logs")  # its TensorBoard callback wrote
