"""The ``keras-replicator`` command line (also ``python -m keras_replicator``).

Sub-commands:
    info    the versions and the devices a ReplicatorStrategy would use here.
    launch  run a script as the worker processes of one multi-worker job.
    k8s     print a Kubernetes JobSet (or TFJob, TrainJob) running a script on N worker pods.

Only ``info`` imports TensorFlow; ``--help``, ``launch`` and ``k8s`` do not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from keras_replicator.launch import config as launch_config

_Number = TypeVar("_Number", int, float)


def _info(args: argparse.Namespace) -> int:
    from keras_replicator import versions

    support = versions.check()
    if support.status == "unsupported":
        print(support.message, file=sys.stderr)  # the same message as `import keras_replicator`
        return 1
    import keras
    import tensorflow as tf

    import keras_replicator as kr

    if args.simulate:
        kr.simulate_devices(args.simulate)
    print(f"keras_replicator {kr.__version__}")
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    print(f"versions: {support.status}: {support.message}")
    from keras_replicator import _compat

    problems = _compat.unchecked_versions()
    print("private-API patches: " + ("checked on these versions" if not problems else "NOT checked:"))
    for line in problems:
        print("  " + line)
    print("devices:", ", ".join(kr.local_devices()))
    return 0


def _number_type(
    convert: Callable[[str], _Number], requirement: str, ok: Callable[[_Number], bool]
) -> Callable[[str], _Number]:
    """An argparse ``type=``: ``convert(text)``, refused unless ``ok``.

    Example:
        ```python
        import argparse
        from keras_replicator.__main__ import _number_type

        parser = argparse.ArgumentParser()
        parser.add_argument("--workers", type=_number_type(int, "at least 1", lambda v: v >= 1))
        parser.parse_args(["--workers", "2"]).workers   # 2; "--workers 0" exits: "must be at least 1, got 0"
        ```
    """
    noun = "an integer" if convert is int else "a number"

    def parse(text: str) -> _Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not ok(value):  # written as "not ok" so that NaN is refused too
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    return parse


_positive_int = _number_type(int, "at least 1", lambda v: v >= 1)
_non_negative_int = _number_type(int, "at least 0", lambda v: v >= 0)
_positive_float = _number_type(float, "positive", lambda v: v > 0)


def _worker_range(text: str) -> int | tuple[int, int]:
    """``--workers`` of ``launch``: N, or MIN:MAX (an elastic job)."""
    if ":" not in text:
        return _positive_int(text)
    from keras_replicator.launch.config import parse_worker_range

    try:
        return parse_worker_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_job_arguments(
    parser: argparse.ArgumentParser, script_help: str, workers_required: bool = True
) -> None:
    """The arguments every job-starting sub-command takes: N workers running one script."""
    if workers_required:
        parser.add_argument("--workers", type=_positive_int, required=True, metavar="N", help="number of workers")
    else:
        parser.add_argument("--workers", type=_worker_range, default=None, metavar="N|MIN:MAX",
                            help="number of workers on this machine (a one-machine job); MIN:MAX "
                            "starts MAX and goes on with fewer, down to MIN, without a worker that "
                            "keeps failing (it restarts and resumes from the backup)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module, run as `python -m SCRIPT` (as torchrun's -m)")
    parser.add_argument("script", help=script_help)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def config_from_args(args: argparse.Namespace) -> launch_config.LaunchConfig:
    """The `LaunchConfig` of ``keras-replicator launch``'s parsed arguments (checked there).

    Example:
        ```python
        args = build_parser().parse_args(["launch", "--workers", "2", "-m", "json.tool"])
        config_from_args(args).command   # [sys.executable, '-m', 'json.tool']
        ```
    """
    from keras_replicator.launch import LaunchConfig  # no TensorFlow: the launcher starts at once

    gpus = None if args.gpus is None else [g for g in args.gpus.split(",") if g.strip()]
    min_workers, workers = args.workers if isinstance(args.workers, tuple) else (None, args.workers)
    return LaunchConfig(
        args.script,
        args.args,
        workers=workers,
        min_workers=min_workers,
        worker_failures=args.worker_failures,
        devices_per_worker=args.devices_per_worker,
        host=args.host,
        hosts=args.hosts,
        node_rank=args.node_rank,
        port=args.port,
        nnodes=args.nnodes,
        master=args.master,
        rendezvous_timeout=args.rendezvous_timeout,
        max_restarts=args.max_restarts,
        ps=args.ps,
        log_dir=args.log_dir,
        tee=args.tee,
        gpus=gpus,
        grace=args.grace,
        timeout=args.timeout,
        module=args.module,
    )


def _launch(args: argparse.Namespace) -> int:
    from keras_replicator.launch import launch

    config = config_from_args(args)
    try:
        return launch(config)
    except TimeoutError as e:  # the rendezvous of --nnodes did not complete
        sys.stderr.write(f"keras-replicator launch: {e}\n")
        return 1


def _k8s(args: argparse.Namespace) -> int:
    from keras_replicator.launch import k8s_manifest

    # Built and checked in full before anything is printed.
    text = k8s_manifest(
        args.script,
        args.args,
        workers=args.workers,
        image=args.image,
        kind=args.kind,
        name=args.name,
        namespace=args.namespace,
        gpus_per_worker=args.gpus_per_worker,
        max_restarts=args.max_restarts,
        restart_policy=args.restart_policy,
        ps=args.ps,
        module=args.module,
        port=args.port,
        save_seconds=args.save_seconds,
        step_seconds=args.step_seconds,
        grace=args.grace,
    )
    sys.stdout.write(text)
    return 0


def _add_grace_arguments(k8s: argparse.ArgumentParser) -> None:
    """`k8s`'s terminationGracePeriodSeconds: from a step and a save's time, or outright."""
    k8s.add_argument("--save-seconds", type=_number_type(float, "at least 0", lambda v: v >= 0), default=30.0,
                     metavar="SECONDS", help="how long a backup takes to save (default 30; measure it: the "
                     "preemption message says 'saved ... in N s')")
    k8s.add_argument("--step-seconds", type=_number_type(float, "at least 0", lambda v: v >= 0), default=10.0,
                     metavar="SECONDS", help="how long a training step takes (default 10)")
    k8s.add_argument("--grace", type=_positive_int, default=None, metavar="SECONDS",
                     help="terminationGracePeriodSeconds outright (default: 2 x (step + save) + 5)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-replicator", description="Replicated training for Keras 3 on TensorFlow."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="versions and the devices a strategy would use")
    info.add_argument("--simulate", type=int, default=0, metavar="N",
                      help="simulate N CPU devices first")
    info.set_defaults(func=_info)

    launch = commands.add_parser(
        "launch",
        help="run a script as the workers of one multi-worker job",
        description="Runs SCRIPT as N worker processes with TF_CONFIG on free ports of HOST, or, "
        "with --hosts, this node's share of a job on several machines (run the same command on "
        "each with its --node-rank). Output lines are prefixed with [worker i]; when a worker "
        "fails the others are stopped and its exit code is returned (or the job restarted, "
        "--max-restarts). SIGINT, SIGTERM and SIGHUP are forwarded to every worker, and the "
        "launcher exits after them. TensorFlow's workers are unauthenticated: keep the job on a "
        "private network.",
    )
    _add_job_arguments(launch, "the Python script every worker runs", workers_required=False)
    launch.add_argument("--devices-per-worker", type=_positive_int, default=None, metavar="K",
                        help="simulate K CPU devices in each worker (overrides the script's "
                        "kr.simulate_devices)")
    launch.add_argument("--host", default="127.0.0.1",
                        help="address the workers reach each other on (default 127.0.0.1)")
    launch.add_argument("--hosts", default=None, metavar="H1:N1,H2:N2",
                        help="every node of a multi-host job with its worker count, in node order")
    launch.add_argument("--node-rank", type=_non_negative_int, default=None, metavar="R",
                        help="this machine's position in --hosts, or its rank of --nnodes")
    launch.add_argument("--port", type=_number_type(int, "in 1..65535", lambda v: 1 <= v <= 65535),
                        default=2222, help="with --hosts: first port of each node's workers "
                        "(default 2222)")
    launch.add_argument("--nnodes", type=_positive_int, default=None, metavar="N",
                        help="number of nodes that find each other through --master (instead of "
                        "--hosts); --workers is then per node and --host this node's address")
    launch.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="with --nnodes: node 0's address and a free port for the rendezvous")
    launch.add_argument("--rendezvous-timeout", type=_positive_float, default=300.0,
                        metavar="SECONDS", help="with --nnodes: how long to wait for every node")
    launch.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="N",
                        help="restart every worker after a failure, up to N times (default 0)")
    launch.add_argument("--worker-failures", type=_positive_int, default=None, metavar="K",
                        help="with --workers MIN:MAX: leave out a worker that was the first to fail "
                        "on K starts of the job in a row (default 2)")
    launch.add_argument("--ps", type=_non_negative_int, default=0, metavar="M",
                        help="a parameter-server job: a chief, the N workers and M ps tasks "
                        "(a failed worker is restarted alone, up to --max-restarts times)")
    launch.add_argument("--log-dir", default=None, metavar="DIR",
                        help="also write each worker's output to DIR/worker_i.log")
    launch.add_argument("--tee", choices=["all", "chief", "none"], default="all",
                        help="whose output to print (default all; a failing worker's last lines "
                        "are printed anyway)")
    launch.add_argument("--gpus", default=None, metavar="IDS",
                        help="GPU ids to split among this machine's workers, e.g. 0,1,2,3 "
                        "(default: CUDA_VISIBLE_DEVICES, else nvidia-smi; '' for none)")
    launch.add_argument("--grace", type=_number_type(float, "at least 0", lambda v: v >= 0),
                        default=None, metavar="SECONDS",
                        help="time between forwarding a stop signal and SIGKILL (default: 5, grown to "
                        "2 x the longest backup save the chief recorded + 5; given: a warning if "
                        "shorter than that)")
    launch.add_argument("--timeout", type=_positive_float, default=None, metavar="SECONDS",
                        help="stop every worker after this long and exit with 124")
    launch.set_defaults(func=_launch)

    k8s = commands.add_parser(
        "k8s",
        help="print a Kubernetes JobSet (or TFJob, TrainJob) for the same job",
        description="Prints a JobSet (jobset.x-k8s.io/v1alpha2) running SCRIPT (a path inside "
        "IMAGE) directly on N worker pods; kr.ReplicatorStrategy() finds the cluster in what "
        "JobSet gives each pod. With --ps M: a chief, the workers and M parameter servers. "
        "--kind tfjob prints a Kubeflow TFJob instead, --kind trainjob a Kubeflow Trainer "
        "TrainJob and its ClusterTrainingRuntime. Apply with: kubectl apply -f -",
    )
    _add_job_arguments(k8s, "the script's path inside the image")
    k8s.add_argument("--image", required=True, help="container image with the script")
    k8s.add_argument("--kind", choices=["jobset", "tfjob", "trainjob"], default="jobset",
                     help="what to print (default jobset)")
    k8s.add_argument("--name", default="keras-replicator", help="the job's name")
    k8s.add_argument("--namespace", default=None)
    k8s.add_argument("--ps", type=_non_negative_int, default=0, metavar="M",
                     help="a parameter-server job: a chief, N workers and M parameter servers")
    k8s.add_argument("--gpus-per-worker", type=_non_negative_int, default=0, metavar="G",
                     help="nvidia.com/gpu limit of each chief and worker pod")
    k8s.add_argument("--max-restarts", type=_non_negative_int, default=0, metavar="N",
                     help="JobSet/TrainJob: restart the whole job after a failure, up to N times "
                     "(failurePolicy.maxRestarts); with --ps a failed worker pod is replaced alone. "
                     "Preemptions (exit 143, pod condition DisruptionTarget) restart it uncounted")
    k8s.add_argument("--port", type=_number_type(int, "in 1..65535", lambda v: 1 <= v <= 65535),
                     default=2222, help="the port every task listens on (default 2222)")
    k8s.add_argument("--restart-policy", default=None, choices=["OnFailure", "Always", "Never", "ExitCode"],
                     help="--kind tfjob only: the pods' restart policy (default OnFailure)")
    _add_grace_arguments(k8s)
    k8s.set_defaults(func=_k8s)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError) as e:
        parser.exit(2, f"keras-replicator {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
