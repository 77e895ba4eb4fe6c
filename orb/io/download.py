"""Fetch orb-models' published weights into the cache, for machines that cannot (compute nodes without internet).

    orb-download orb_v3_conservative_inf_omat orb_v2        # on a login node, ORB_CACHE_DIR on the shared file system
    orb-download --all
    orb-download --list                                     # names, addresses, and which are cached

Each file is verified and its MindSpore copy made, so a job that names the weights (``checkpoint_path: NAME``,
``--checkpoint NAME``, ``ORBCalculator.from_pretrained(NAME)``) reads the cache and never touches the network.
``ORB_WEIGHTS_URL`` serves them from a mirror laid out as orb-models' host (``<URL>/forcefields/...``).
"""

import argparse
from typing import Optional


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """orb-download's options."""
    from orb.commands import HelpFormatter, Parser
    from orb.pretrained import PUBLISHED

    parser = Parser(prog=prog, allow_abbrev=False, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"published weights to fetch (default: none): {', '.join(PUBLISHED)}")
    parser.add_argument("--all", action="store_true", help="fetch every published name (default: off)")
    parser.add_argument("--list", action="store_true", help="list the names, their addresses and which are cached, "
                        "then exit (default: off)")
    parser.add_argument("--progress_bar", choices=("auto", "true", "false"), default="auto",
                        help="show the download's progress (auto: when attached to a terminal) (default: auto)")
    return parser


def main(argv=None) -> int:
    from orb.signals import run_command

    return run_command(lambda: download(build_parser().parse_args(argv)))


def download(args) -> int:
    from orb import pretrained
    from orb.errors import ConfigError

    if args.list:
        cached = set(pretrained.cached_names())
        for name in pretrained.PUBLISHED:
            print(f"{name:30s} {'cached ' if name in cached else '       '} {pretrained.weights_url(name)}")
        return 0
    names = list(pretrained.PUBLISHED) if args.all else [pretrained.require_name(n) for n in args.names]
    if not names:
        raise ConfigError("name the weights to fetch (orb-download NAME ..., or --all; --list lists them)")
    progress = None if args.progress_bar == "auto" else args.progress_bar == "true"
    from orb.device import import_mindspore

    import_mindspore()
    from orb.io.checkpoint import published_weights

    for name in dict.fromkeys(names):
        source = pretrained.fetch(name, progress)
        record = pretrained.read_record(source)
        published_weights(name, progress)
        print(f"{name}: {source} ({record['size'] / 2 ** 20:.1f} MiB, sha256 {record['sha256']})")
    return 0


if __name__ == "__main__":
    from orb.signals import run_program

    run_program(main)
