"""Tiny KerasHub models built from configs (no download), shared by the KerasHub tests.

Local text, the tokenizers' vocabularies made from it (WordPiece for BERT, a
byte-pair vocabulary with whole-word merges for GPT-2, a SentencePiece proto trained
here for Gemma) and builders that set Keras's seed first, so that a model built in a
strategy's scope and one built outside start from the same weights. Dropout is 0
everywhere: N replicas draw other dropout masks than one device does.
"""

from __future__ import annotations

import io

import keras
import keras_hub

# Local text: 32 short sentences over a small vocabulary (lower case, no punctuation).
_SUBJECTS = ["the cat", "a dog", "the bird", "my fish"]
_VERBS = ["sees", "likes", "finds", "hears"]
_OBJECTS = ["the sun", "a tree", "the moon", "some rain"]
TEXT = [f"{s} {v} {_OBJECTS[(i + j + k) % 4]}" for i, s in enumerate(_SUBJECTS)
        for j, v in enumerate(_VERBS) for k in range(2)]
LABELS = [int(sentence.split()[1] in ("cat", "dog")) for sentence in TEXT]  # a pet or not
WORDS = sorted({w for sentence in TEXT for w in sentence.split()})
SEQUENCE_LENGTH = 8
HIDDEN, INTERMEDIATE, HEADS, LAYERS = 16, 32, 2, 2
# How every side of a comparison trains: 4 global batches of 8 a epoch.
FIT = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
PROMPTS = ["the cat", "a dog", "my fish", "the bird"]


def bert_tokenizer() -> keras_hub.models.BertTokenizer:
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    return keras_hub.models.BertTokenizer(vocabulary=vocabulary)


def bert_backbone(tokenizer, seed: int = 1, dtype=None) -> keras_hub.models.BertBackbone:
    keras.utils.set_random_seed(seed)
    return keras_hub.models.BertBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=LAYERS, num_heads=HEADS,
        hidden_dim=HIDDEN, intermediate_dim=INTERMEDIATE, dropout=0.0,
        max_sequence_length=SEQUENCE_LENGTH, dtype=dtype)


def bert_classifier(tokenizer, seed: int = 1, dtype=None) -> keras_hub.models.BertTextClassifier:
    """A 2-class ``BertTextClassifier`` with its preprocessor (strings in)."""
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=SEQUENCE_LENGTH)
    backbone = bert_backbone(tokenizer, seed, dtype)
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=preprocessor, dropout=0.0)


def gpt2_tokenizer() -> keras_hub.models.GPT2Tokenizer:
    """Byte-pair vocabulary with whole-word merges: "Ġ" marks a word after a space."""
    vocabulary, merges = {"<|endoftext|>": 0}, []

    def add(token):
        vocabulary.setdefault(token, len(vocabulary))

    for word in WORDS:
        for piece in (word, "Ġ" + word):
            for ch in piece:
                add(ch)
            for end in range(2, len(piece) + 1):
                merge = (piece[:end - 1], piece[end - 1])
                if f"{merge[0]} {merge[1]}" not in merges:
                    merges.append(f"{merge[0]} {merge[1]}")
                add(piece[:end])
    return keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)


def gpt2_causal_lm(tokenizer, seed: int = 1, lora_rank: int | None = None, dtype=None):
    """A ``GPT2CausalLM`` with its preprocessor; ``lora_rank`` enables LoRA on the backbone."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=LAYERS, num_heads=HEADS,
        hidden_dim=HIDDEN, intermediate_dim=INTERMEDIATE, dropout=0.0,
        max_sequence_length=2 * SEQUENCE_LENGTH, dtype=dtype)
    if lora_rank:
        backbone.enable_lora(rank=lora_rank)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, sequence_length=SEQUENCE_LENGTH)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=preprocessor)


def compile_causal_lm(model, learning_rate: float = 1e-2, optimizer=None) -> None:
    """Adam (or ``optimizer``), and greedy sampling: ``generate`` is deterministic."""
    optimizer = optimizer or keras.optimizers.Adam(learning_rate)
    model.compile(optimizer=optimizer, sampler="greedy")


def gemma_proto() -> bytes:
    """A SentencePiece model of the local text, trained here (Gemma's special pieces)."""
    import sentencepiece

    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_writer=proto, vocab_size=len(WORDS) + 8,
        model_type="WORD", pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        pad_piece="<pad>", bos_piece="<bos>", eos_piece="<eos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    return proto.getvalue()


def gemma_causal_lm(proto: bytes, seed: int = 1, dtype=None):
    """A 2-layer Gemma-architecture ``GemmaCausalLM`` (multi-query attention, head 8)."""
    tokenizer = keras_hub.models.GemmaTokenizer(proto=proto)
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=LAYERS, num_query_heads=HEADS,
        num_key_value_heads=1, hidden_dim=HIDDEN, intermediate_dim=INTERMEDIATE, head_dim=8,
        dropout=0.0, dtype=dtype)
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=SEQUENCE_LENGTH)
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=preprocessor)


def masked_lm(tokenizer, seed: int = 1) -> keras_hub.models.BertMaskedLM:
    """keras-io's data-parallel recipe's ``BertMaskedLM``, config-built and compiled as there
    (no preprocessor: it is fed fixed masked batches, see ``masked_batches``)."""
    model = keras_hub.models.BertMaskedLM(bert_backbone(tokenizer, seed), preprocessor=None)
    model.backbone.get_layer("pooled_dense").trainable = False  # keras-io: get_layer("bert_backbone")
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.AdamW(learning_rate=1e-2),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        jit_compile=False,
    )
    return model


def masked_batches(tokenizer, seed: int = 3):
    """``TEXT`` masked once by ``BertMaskedLMPreprocessor`` (its masks are random): (x, y,
    sample_weight) as NumPy, the same for every side of a comparison."""
    import numpy as np
    import tensorflow as tf

    tf.random.set_seed(seed)
    preprocessor = keras_hub.models.BertMaskedLMPreprocessor(
        tokenizer, sequence_length=SEQUENCE_LENGTH, mask_selection_rate=0.25, mask_selection_length=3)
    x, y, sample_weight = preprocessor(tf.constant(TEXT))
    return {k: np.asarray(v) for k, v in x.items()}, np.asarray(y), np.asarray(sample_weight)
