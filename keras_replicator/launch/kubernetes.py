"""A Kubeflow ``TFJob`` manifest running a script on N worker pods (``keras-replicator k8s``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from keras_replicator._validation import check_int
from keras_replicator.launch.config import _check_module_name

_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _yaml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML double-quoted scalar


def k8s_manifest(
    script: str,
    args: Sequence[str] = (),
    *,
    workers: int,
    image: str,
    name: str = "keras-replicator",
    namespace: str | None = None,
    gpus_per_worker: int = 0,
    restart_policy: str = "OnFailure",
    python: str = "python",
    ps: int = 0,
    module: bool = False,
) -> str:
    """A Kubeflow ``TFJob`` manifest (YAML) running ``script`` on ``workers`` pods.

    The training operator creates one pod per worker and sets ``TF_CONFIG`` in
    each, so the same script that `launch` runs locally runs unchanged.
    Worker 0 is the chief. With ``restart_policy="OnFailure"`` a failed pod is
    restarted; with ``keras.callbacks.BackupAndRestore`` writing to a volume all
    pods share, the job resumes from the last saved epoch.

    Example:
        ```python
        from keras_replicator.launch import k8s_manifest
        print(k8s_manifest("train.py", workers=4, image="registry.example/train:1"))
        ```

    Args:
        script: the script's path inside the image.
        args: its command-line arguments.
        workers: number of worker pods, >= 1.
        image: the container image holding TensorFlow, keras_replicator and the script.
        name: the TFJob's name (a Kubernetes name: lower-case letters, digits, '-').
        namespace: the Kubernetes namespace; ``None`` for the current one.
        gpus_per_worker: ``nvidia.com/gpu`` limit per pod (0: none).
        restart_policy: ``"OnFailure"``, ``"Always"``, ``"Never"`` or ``"ExitCode"``.
        python: the interpreter command inside the image.
        ps: parameter-server pods: with ``ps=M`` the TFJob has a ``Chief`` (the
            coordinator of asynchronous training), ``workers`` ``Worker`` pods and
            ``M`` ``PS`` pods, each with the same container (GPUs for the chief
            and workers only).
        module: ``script`` is a module name, run as ``python -m script``.

    Returns:
        The manifest, for ``kubectl apply -f -``.
    """
    if module:
        _check_module_name(script)
    elif not isinstance(script, str) or not script:
        raise ValueError(f"script must be a path inside the image, got {script!r}.")
    args = list(args)
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be strings, got {args!r}.")
    check_int("workers", workers, minimum=1)
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise ValueError(f"image must be a container image reference, got {image!r}.")
    for label, value in (("name", name), ("namespace", namespace)):
        if value is None and label == "namespace":
            continue
        if not isinstance(value, str) or len(value) > 63 or not _K8S_NAME.fullmatch(value):
            raise ValueError(
                f"{label} must be a Kubernetes name (at most 63 lower-case letters, digits or '-', "
                f"starting and ending with a letter or digit), got {value!r}."
            )
    check_int("gpus_per_worker", gpus_per_worker, minimum=0)
    policies = ("OnFailure", "Always", "Never", "ExitCode")
    if restart_policy not in policies:
        raise ValueError(f"restart_policy must be one of {policies}, got {restart_policy!r}.")

    ps = check_int("ps", ps, minimum=0)

    run = [python, "-m", script] if module else [python, script]
    command = ", ".join(_yaml_str(c) for c in [*run, *args])
    lines = [
        "apiVersion: kubeflow.org/v1",
        "kind: TFJob",
        "metadata:",
        f"  name: {name}",
        *([f"  namespace: {namespace}"] if namespace else []),
        "spec:",
        "  runPolicy:",
        "    cleanPodPolicy: Running",
        "  tfReplicaSpecs:",
    ]
    replicas = [("Chief", 1), ("Worker", workers), ("PS", ps)] if ps else [("Worker", workers)]
    for kind, count in replicas:
        lines += [
            f"    {kind}:",
            f"      replicas: {count}",
            f"      restartPolicy: {restart_policy}",
            "      template:",
            "        spec:",
            "          containers:",
            "            - name: tensorflow  # the training operator expects this name",
            f"              image: {_yaml_str(image)}",
            f"              command: [{command}]",
            "              ports:",
            "                - name: tfjob-port",
            "                  containerPort: 2222",
        ]
        if gpus_per_worker and kind != "PS":
            lines += [
                "              resources:",
                "                limits:",
                f"                  nvidia.com/gpu: {gpus_per_worker}",
            ]
    return "\n".join(lines) + "\n"
