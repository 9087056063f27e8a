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


def build_optimizer_slots(model) -> None:
    """Builds a compiled one-device model's optimizer slots now, not in its first ``fit``'s trace,
    where Keras creates them and then traces the step a second time: the same zeros, so the same
    training, for about a quarter less of that fit's time. Only for the one-device references:
    the replicated models create theirs as a user's do."""
    model.optimizer.build(model.trainable_variables)


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


# --- the backbones with a get_layout_map, as tiny token-id causal LMs (tests/test_kerashub_layouts.py) ---

LAYOUT_VOCABULARY, LAYOUT_HIDDEN = 64, 16
# name -> (backbone, causal LM, the backbone's arguments beyond the common ones, ties it can take).
# Head counts divide 4 (Gemma's Q/K/V split the heads over the model axis of a (1, 4) mesh), the
# router aux loss is 0: each replica's load-balancing loss is a statistic of its own tokens.
LAYOUT_MODELS = {
    "gemma": ("GemmaBackbone", "GemmaCausalLM", dict(head_dim=4), (True,)),
    "llama": ("LlamaBackbone", "LlamaCausalLM", {}, (False, True)),
    "llama3": ("Llama3Backbone", "Llama3CausalLM", {}, (False, True)),
    "qwen": ("QwenBackbone", "QwenCausalLM", {}, (True, False)),
    "qwen_moe": ("QwenMoeBackbone", "QwenMoeCausalLM",
                 dict(moe_intermediate_dim=8, shared_expert_intermediate_dim=16, num_experts=4, top_k=2,
                      router_aux_loss_coefficient=0.0), (False, True)),
    "qwen3_moe": ("Qwen3MoeBackbone", "Qwen3MoeCausalLM",
                  dict(moe_intermediate_dim=8, num_experts=4, top_k=2, head_dim=4,
                       router_aux_loss_coefficient=0.0), (False, True)),
}


def layout_backbone_class(name: str):
    return getattr(keras_hub.models, LAYOUT_MODELS[name][0])


def layout_causal_lm(name: str, tied: bool, optimizer=None, seed: int = 1):
    """A 1-layer ``name`` causal LM (hidden 16, 4 heads, vocabulary 64), no preprocessor (token ids
    in), compiled with AdamW (or ``optimizer``) and greedy sampling."""
    backbone_name, lm_name, extra, ties = LAYOUT_MODELS[name]
    if tied not in ties:
        raise ValueError(f"{backbone_name} cannot be built with tie_word_embeddings={tied}")
    arguments = dict(vocabulary_size=LAYOUT_VOCABULARY, num_layers=1, num_query_heads=4, num_key_value_heads=4,
                     hidden_dim=LAYOUT_HIDDEN, intermediate_dim=32, dropout=0.0, **extra)
    if len(ties) > 1:
        arguments["tie_word_embeddings"] = tied
    keras.utils.set_random_seed(seed)
    backbone = getattr(keras_hub.models, backbone_name)(**arguments)
    model = getattr(keras_hub.models, lm_name)(backbone, preprocessor=None)
    model.compile(optimizer=optimizer or keras.optimizers.AdamW(1e-2), sampler="greedy")
    return model


def layout_batches(rows: int = 16, seed: int = 0):
    """Token ids for 2 steps of 8 rows: (x, y, sample_weight), next-token targets, the last 2
    positions of the second half padded; and 2 greedy prompts of 3 tokens (padding after)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(1, LAYOUT_VOCABULARY, (rows, SEQUENCE_LENGTH)).astype("int32")
    mask = np.ones_like(ids, dtype=bool)
    mask[rows // 2:, -2:] = False
    ids[~mask] = 0
    x = {"token_ids": ids, "padding_mask": mask}
    y = np.concatenate([ids[:, 1:], np.zeros((rows, 1), "int32")], axis=1)
    sample_weight = np.concatenate([mask[:, 1:], np.zeros((rows, 1), bool)], axis=1)
    prompts = {"token_ids": np.where(np.arange(SEQUENCE_LENGTH) < 3, ids[:2], 0).astype("int32"),
               "padding_mask": np.broadcast_to(np.arange(SEQUENCE_LENGTH) < 3, (2, SEQUENCE_LENGTH)).copy()}
    return x, y, sample_weight, prompts
