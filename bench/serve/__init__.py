"""Served decode and prefill on CPU, `leapctl serve` against what a user runs instead:

    python -m bench.serve --format bitmap-q4 [options]
    python -m bench.serve --format bitmap [options]

bitmap-q4 (`q4`): every server of --servers in turn, or with --interleave N all up at once and measured in
N interleaved rounds (what to quote on a shared machine). bitmap (`bitmap`): the two servers in turn, 1 and 8
clients, greedy agreement, --profile splits a decode step. Both on `common` (servers started and stopped by
`leapctl serve`'s own launcher, streamed requests, memory sampling, vLLM's profiler). Results under
bench/results/serve/; `--format F --help` lists a study's options."""

import argparse
import importlib
import sys

STUDIES = {"bitmap-q4": "q4", "bitmap": "bitmap"}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="bitmap-q4", choices=list(STUDIES))
    known, rest = parser.parse_known_args(argv)
    if any(a in ("-h", "--help") for a in rest) and "--format" not in " ".join(argv):
        parser.print_help()
        return
    sys.argv[0] = f"python -m bench.serve --format {known.format}"  # the study's usage line
    importlib.import_module(f"bench.serve.{STUDIES[known.format]}").main(rest)
