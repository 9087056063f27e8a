"""The ``keras-replicator`` command line (also ``python -m keras_replicator``).

Sub-commands:
    info    the versions and the devices a ReplicatorStrategy would use here.
"""

from __future__ import annotations

import argparse
import sys


def _info(args: argparse.Namespace) -> int:
    import keras
    import tensorflow as tf

    import keras_replicator as kr

    if args.simulate:
        kr.simulate_devices(args.simulate)
    print(f"keras_replicator {kr.__version__}")
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    print("devices:", ", ".join(kr.local_devices()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-replicator", description="Replicated training for Keras 3 on TensorFlow."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="versions and the devices a strategy would use")
    info.add_argument("--simulate", type=int, default=0, metavar="N",
                      help="simulate N CPU devices first")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
