"""The entries of a run's JSON that a table row compares, and the names the report gives them."""

from __future__ import annotations

from typing import Any

ALLREDUCE_NAMES = {
    "stock_default": "stock default",
    "stock_rtod": "stock `ReductionToOneDevice`",
    "ours": "ours",
}
STRATEGY_NAMES = {
    "one": "one device",
    "stock": "stock `MirroredStrategy`",
    "ours": "`ReplicatorStrategy`",
    "reference": "replica-work reference",
}
MODEL_NAMES = {"cnn": "small CNN", "resnet50": "ResNet-50 (32x32)", "cnn_bn": "CNN + BN",
               "resnet50_bn": "ResNet-50's BN layers", "sngan": "SN-GAN (16x16)"}
# Batch-norm comparisons in a whole model whose batch-norm layers are a small part
# of a step: the layers' difference is below what a run resolves there, so such a
# model checks that GlobalBatchNormalization is not resolved slower (its 90%
# interval entirely above 1.0) rather than deciding the target (see targets.batch_norm_target).
WHOLE_MODEL_BN = ("resnet50",)


def find(entries: list[dict], **key) -> dict | None:
    """The first available entry whose fields match ``key``, or None."""
    for e in entries:
        if all(e.get(k) == v for k, v in key.items()) and e.get("available"):
            return e
    return None


def one_device(doc: dict[str, Any], model: str, devices: int | str) -> dict | None:
    """The one-device baseline of a row: GPU:0 for GPU rows, one CPU device otherwise."""
    return find(doc["training"], model=model, strategy="one",
                devices="gpu1" if devices == "gpu" else 1)


def reference(doc: dict[str, Any], e: dict) -> dict | None:
    """The replica-work reference of training row ``e`` (one device doing its replicas' work)."""
    return find(doc["training"], model=e["model"], strategy="reference", devices=e["devices"])


def ours_at_spe8(doc: dict[str, Any], model: str, devices: int | str) -> dict | None:
    """Ours with ``steps_per_execution=8`` on a training row's model and devices."""
    return find(doc["steps_per_execution"], model=model, devices=devices, steps_per_execution=8)


def batch_norm_pairs(doc: dict[str, Any]) -> list[tuple[str, dict, dict]]:
    """``(model, Keras sync BN entry, GlobalBatchNormalization entry)`` per model measured,
    those of ``WHOLE_MODEL_BN`` last."""
    pairs = []
    for model in dict.fromkeys(e.get("model", "cnn_bn") for e in doc["batch_norm"]):
        sync = find(doc["batch_norm"], model=model, batch_norm="keras_sync")
        glob = find(doc["batch_norm"], model=model, batch_norm="global")
        if sync and glob:
            pairs.append((model, sync, glob))
    return sorted(pairs, key=lambda pair: pair[0] in WHOLE_MODEL_BN)  # whole models last
