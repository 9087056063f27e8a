"""keras-io's "Data Parallel Training with KerasHub and tf.distribute", under ReplicatorStrategy.

keras-io's ``examples/nlp/data_parallel_training_with_keras_hub.py`` (Anshuman Mishra,
2023) trains a BERT masked LM under ``tf.distribute.MirroredStrategy``. On TensorFlow
2.21 with Keras 3.15 and keras-hub 0.32 it fails at its first step: Keras reduces the
first batch to build the model, and the preprocessor's bool ``padding_mask`` is not a
type ``AddN`` takes ("Value for attr 'T' of bool is not in the list of allowed values").
Here it is with ``kr.ReplicatorStrategy()``, changed only where marked CHANGED:

- the strategy;
- 4 simulated CPU devices instead of one GPU split in two logical devices;
- the text is read from a local directory (wikitext-2's file names; pass
  ``~/.keras/datasets/wikitext-2`` after keras-io's download to use wikitext-2 itself);
- the BERT is built from a config with a vocabulary of the local text, instead of
  ``BertMaskedLM.from_preset("bert_tiny_en_uncased")`` (no download).

Usage::

    python examples/kerashub_data_parallel.py TEXT_DIR
    python examples/kerashub_data_parallel.py --write-sample-text TEXT_DIR  # writes a small text first
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras_replicator as kr  # CHANGED

kr.simulate_devices(4)  # CHANGED: 4 CPU devices (keras-io: one GPU as 2 logical devices)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import tensorflow as tf  # noqa: E402

EPOCHS = 3

# CHANGED: local text, in wikitext-2's file names.
SAMPLE = [
    f"{s} {v} {o} and {o2} {v} {s} while the wind {v} the hill and {s} {v} the river at night"
    for s in ("the cat", "a dog", "the bird", "my fish")
    for v in ("sees", "likes", "finds", "hears")
    for o, o2 in (("the sun", "a tree"), ("the moon", "some rain"))
]


def write_sample_text(directory):
    os.makedirs(directory, exist_ok=True)
    for name, lines in (("wiki.train.tokens", SAMPLE * 4), ("wiki.valid.tokens", SAMPLE[:8]),
                        ("wiki.test.tokens", SAMPLE[8:16])):
        with open(os.path.join(directory, name), "w") as f:
            f.write("\n".join(lines) + "\n")


if sys.argv[1] == "--write-sample-text":
    write_sample_text(sys.argv[2])
wiki_dir = os.path.expanduser(sys.argv[-1]) + "/"

strategy = kr.ReplicatorStrategy()  # CHANGED: tf.distribute.MirroredStrategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}")

base_batch_size = 32
base_learning_rate = 1e-4

scaled_batch_size = base_batch_size * strategy.num_replicas_in_sync
scaled_learning_rate = base_learning_rate * strategy.num_replicas_in_sync

wiki_train_ds = (
    tf.data.TextLineDataset(
        wiki_dir + "wiki.train.tokens",
    )
    .filter(lambda x: tf.strings.length(x) > 100)
    .shuffle(buffer_size=500)
    .batch(scaled_batch_size)
    .cache()
    .prefetch(tf.data.AUTOTUNE)
)
wiki_val_ds = (
    tf.data.TextLineDataset(wiki_dir + "wiki.valid.tokens")
    .filter(lambda x: tf.strings.length(x) > 100)
    .shuffle(buffer_size=500)
    .batch(scaled_batch_size)
    .cache()
    .prefetch(tf.data.AUTOTUNE)
)
wiki_test_ds = (
    tf.data.TextLineDataset(wiki_dir + "wiki.test.tokens")
    .filter(lambda x: tf.strings.length(x) > 100)
    .shuffle(buffer_size=500)
    .batch(scaled_batch_size)
    .cache()
    .prefetch(tf.data.AUTOTUNE)
)

total_training_steps = sum(1 for _ in wiki_train_ds.as_numpy_iterator()) * EPOCHS
lr_schedule = tf.keras.optimizers.schedules.PolynomialDecay(
    initial_learning_rate=scaled_learning_rate,
    decay_steps=total_training_steps,
    end_learning_rate=0.0,
)


class PrintLR(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(
            f"\nLearning rate for epoch {epoch + 1} is {model_dist.optimizer.learning_rate.numpy()}"
        )


callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir="./logs"),
    PrintLR(),
]


print(tf.config.list_physical_devices("GPU"))


def bert_masked_lm_from_config():
    """CHANGED: ``keras_hub.models.BertMaskedLM.from_preset("bert_tiny_en_uncased")`` built from
    a config (bert_tiny's 2 layers and 2 heads, smaller widths) and a vocabulary of the text."""
    words = set()
    for name in ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"):
        with open(wiki_dir + name) as f:
            words.update(f.read().lower().split())
    tokenizer = keras_hub.models.BertTokenizer(
        vocabulary=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)], lowercase=True)
    preprocessor = keras_hub.models.BertMaskedLMPreprocessor(tokenizer, sequence_length=32)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=32)
    return keras_hub.models.BertMaskedLM(backbone, preprocessor=preprocessor)


with strategy.scope():
    # Everything that creates variables should be under the strategy scope.
    # In general this is only model construction & `compile()`.
    model_dist = bert_masked_lm_from_config()  # CHANGED: from_preset("bert_tiny_en_uncased")

    # This line just sets pooled_dense layer as non-trainiable, we do this to avoid
    # warnings of this layer being unused
    model_dist.get_layer("bert_backbone").get_layer("pooled_dense").trainable = False

    model_dist.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.AdamW(learning_rate=scaled_learning_rate),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        jit_compile=False,
    )

    model_dist.fit(
        wiki_train_ds, validation_data=wiki_val_ds, epochs=EPOCHS, callbacks=callbacks
    )

model_dist.evaluate(wiki_test_ds)
