"""Two builds of the native CPU kernel side by side: the int8 op (`bitmap_q4_i8_linear`, what `leapctl serve`
runs on bitmap-q4 layers) per layer from DRAM, each build in its own process, the builds alternated round by
round.

    python -m bench.kernels --format bitmap-q4 --phase decode --base REV [--head REV_OR_DIR]
        [--models Llama-3.2-1B] [--layers gate/up down] [--sparsities 0.5] [--tokens 1]
        [--layouts dense sparse] [--rounds 5] [--calls 9] [--rotate-mib 256] [--core 1]
        [--out bench/results/kernels/ab_kernels]

Why: on a shared 2-core machine one build's figure moves by 10-30% from run to run, more than most kernel
changes, and two builds cannot be loaded into one process under one op namespace. So each round runs every
build once, in a fresh process, in alternating order, and the report gives per build the median over rounds
(of each round's median over --calls calls): a drift of the machine hits both builds alike.

--base and --head name a git revision of this repository (extracted once with `git archive` into
$LEAPCTL_CACHE/bench/ab_trees/COMMIT) or a folder holding a leapctl tree; --head defaults to this working
tree. Each tree's kernel is built from that tree's `serving/csrc` (its own build folder: the name hashes the
sources) before the first round. The weights are this tree's: random, masks of exactly the given density in
every row, codes on the asymmetric grid (group 64), packed by each build's own `bitmap_q4_pack_pairs` into
the pair layouts named in --layouts (dense: every column a code, pruned ones at their group's zero point,
what AVX2 CPUs serve; sparse: masks and kept codes, what AVX-512 CPUs serve). Each build's result is checked
against the dense matmul, and the report says whether the two builds' outputs are bit for bit the same.

Writes OUT.json (settings, every round's figures) and OUT.md (the table).
"""

import argparse
import hashlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from bench.harness import REPO as ROOT
from bench.harness import RESULTS
from bench.kernels.q4 import LAYERS, random_q4
from leapctl.paths import cache_dir
from leapctl.quantize.config import ASYMMETRIC
from sparse_formats import get_format

GROUP = 64  # the int8 op's group size
LAYOUTS = {"dense": True, "sparse": False}  # name -> bitmap_q4_pack_pairs' pruned_at_zero


def tree_of(spec: str) -> Path:
    """A leapctl tree: `spec` itself if it is a folder with serving/csrc, else a git revision of this
    repository extracted (once) into the cache."""
    if (Path(spec) / "serving" / "csrc").is_dir():
        return Path(spec).resolve()
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{spec}^{{commit}}"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"ab_kernels: {spec!r} is neither a leapctl tree nor a git revision") from None
    tree = cache_dir() / "bench" / "ab_trees" / commit[:12]
    if not (tree / "serving" / "csrc").is_dir():
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True,
                                 check=True).stdout
        partial = tree.with_name(f".{tree.name}.tmp-{os.getpid()}")
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(partial, filter="data")
        partial.replace(tree)
    return tree


def load_kernel(tree: Path):
    """`tree`'s serving/cpu_kernel.py as a module of its own (it needs only torch), built and loaded: the op
    namespace `leap_sparse_cpu` is then that tree's build."""
    spec = importlib.util.spec_from_file_location("ab_cpu_kernel", tree / "serving" / "cpu_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not module.load():
        raise SystemExit(f"ab_kernels: {tree}'s kernel: {module.unavailable_reason()}")
    if not torch.ops.leap_sparse_cpu.bitmap_q4_i8_available():
        raise SystemExit("ab_kernels: this CPU has no int8 kernel (AVX2, or AVX-512 with VNNI, VBMI2, GFNI)")
    return module


def encoded(n: int, k: int, sparsity: float) -> dict[str, torch.Tensor]:
    """A random [n, k] weight on the asymmetric grid, exactly `sparsity` pruned in every row, as bitmap-q4;
    made once (the grid search takes a minute on the 1B shape's largest layers) into the cache, where every
    round of every build reads the same file."""
    path = cache_dir() / "bench" / "ab_weights" / f"{n}x{k}-{sparsity}-g{GROUP}.safetensors"
    if path.is_file():
        return load_file(path)
    tensors, _ = random_q4(n, k, sparsity, GROUP, seed=n * 31 + k, grid=ASYMMETRIC)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({name: t.contiguous() for name, t in tensors.items()}, partial)
    partial.replace(path)
    return tensors


def child(args) -> None:
    """One build's round: every layer, sparsity, layout and M, one JSON line each."""
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    kernel = load_kernel(Path(args.child))
    op, pack = torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear, torch.ops.leap_sparse_cpu.bitmap_q4_pack_pairs
    for model in args.models:
        for layer in args.layers:
            n, k = LAYERS[model][layer]
            for sparsity in args.sparsities:
                q4 = encoded(n, k, sparsity)
                dense = get_format("bitmap-q4").decode(q4)
                stored = (q4["bitmap"], q4["codes"], q4["scales"], q4["row_offsets"])
                for layout in args.layouts:
                    made = tuple(pack(*stored, k, q4["zeros"], LAYOUTS[layout]))
                    size = sum(t.numel() * t.element_size() for t in made)
                    copies = [tuple(t.clone() for t in made) for _ in range(max(2, math.ceil(
                        (args.rotate_mib << 20) / size)))]
                    for m in args.tokens:
                        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
                        y = op(x, *made[:4], n, k, None, made[4])
                        ref = F.linear(x.float(), dense)
                        if not torch.allclose(y.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item()):
                            raise SystemExit(f"ab_kernels: {args.child} disagrees with the dense matmul on "
                                             f"{model} {layer} {layout} M={m}")
                        [op(x, *w[:4], n, k, None, w[4]) for w in copies]  # page the copies in
                        times = []
                        for _ in range(args.calls):
                            start = time.perf_counter()
                            for w in copies:
                                op(x, *w[:4], n, k, None, w[4])
                            times.append((time.perf_counter() - start) / len(copies))
                        us = statistics.median(times) * 1e6
                        digest = hashlib.sha256(y.float().numpy().tobytes()).hexdigest()[:16]
                        print(json.dumps({"model": model, "layer": layer, "sparsity": sparsity,
                                          "layout": layout, "m": m, "us": round(us, 2), "bytes": size,
                                          "isa": kernel.current_isa(), "digest": digest}), flush=True)


def run_round(tree: Path, args) -> list[dict]:
    command = [sys.executable, "-m", "bench.kernels.ab", "--child", str(tree), "--calls", str(args.calls),
               "--rotate-mib", str(args.rotate_mib), "--models", *args.models, "--layers", *args.layers,
               "--sparsities", *map(str, args.sparsities), "--layouts", *args.layouts,
               "--tokens", *map(str, args.tokens)]
    if args.core is not None:
        command += ["--core", str(args.core)]
    # Each other tree builds into a folder of its own: torch's build folder is named after the sources, and
    # two trees with the same sources at two paths would otherwise rebuild it at every switch.
    env = dict(os.environ)
    if tree != ROOT:
        env["TORCH_EXTENSIONS_DIR"] = str(tree / ".torch_extensions")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"ab_kernels: the round of {tree} failed: "
                         f"{(done.stderr.strip().splitlines() or ['exit ' + str(done.returncode)])[-1]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(rows: list[dict], names: dict[str, str]) -> str:
    lines = [f"| model | layer | sparsity | layout | M | base us ({names['base']}) | "
             f"head us ({names['head']}) | head speed-up | head GB/s | same output |", "| --- " * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['layer']} | {r['sparsity']} | {r['layout']} | {r['m']} | "
                     f"{r['base_us']:.1f} | {r['head_us']:.1f} | {r['speedup']:.3f} | {r['head_gbs']:.2f} | "
                     f"{'yes' if r['same'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="git revision or leapctl tree (required unless --child)")
    parser.add_argument("--head", default=str(ROOT))
    parser.add_argument("--models", nargs="+", default=["Llama-3.2-1B"], choices=list(LAYERS))
    parser.add_argument("--layers", nargs="+", default=["gate/up", "down"])
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.5])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=9)
    parser.add_argument("--rotate-mib", type=int, default=256)
    parser.add_argument("--core", type=int, default=None, help="pin each round's process to this core")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels" / "ab_kernels")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for model in args.models:
        unknown = set(args.layers) - set(LAYERS[model])
        if unknown:
            parser.error(f"{model} has no layer {', '.join(sorted(unknown))} "
                         f"(it has {', '.join(LAYERS[model])})")
    if args.child:
        return child(args)
    if args.base is None:
        parser.error("--base is required")
    trees = {"base": tree_of(args.base), "head": tree_of(args.head)}
    for model in args.models:  # the weights, once, before any round
        for layer in args.layers:
            for sparsity in args.sparsities:
                encoded(*LAYERS[model][layer], sparsity)
    rounds = []
    for i in range(args.rounds):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))
        for which in order:
            start = time.monotonic()
            figures = run_round(trees[which], args)
            rounds.append({"round": i, "build": which, "figures": figures})
            print(f"round {i + 1}/{args.rounds} {which}: " + ", ".join(
                f"{f['layer']} {f['layout']} M={f['m']} {f['us']:.1f} us" for f in figures)
                + f" ({time.monotonic() - start:.0f} s with the build's start)", flush=True)
    key = ("model", "layer", "sparsity", "layout", "m")
    merged: dict[tuple, dict] = {}
    for entry in rounds:
        for f in entry["figures"]:
            row = merged.setdefault(tuple(f[name] for name in key), {name: f[name] for name in key})
            row.setdefault(entry["build"], []).append(f)
    rows = []
    for row in merged.values():
        base, head = row.pop("base"), row.pop("head")
        base_us, head_us = statistics.median(f["us"] for f in base), statistics.median(f["us"] for f in head)
        rows.append({**row, "base_us": round(base_us, 2), "head_us": round(head_us, 2),
                     "speedup": round(base_us / head_us, 3),
                     "head_gbs": round(head[0]["bytes"] / head_us / 1e3, 2),
                     "same": base[0]["digest"] == head[0]["digest"]})
    names = {which: args.base if which == "base" else args.head for which in trees}
    meta = {"base": args.base, "head": args.head, "trees": {w: str(t) for w, t in trees.items()},
            "isa": rounds[0]["figures"][0]["isa"], "rounds": args.rounds, "calls": args.calls,
            "rotate_mib": args.rotate_mib, "core": args.core,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {"meta": meta, "rows": rows, "rounds": rounds}
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(rows, names)
    args.out.with_suffix(".md").write_text(f"{text}\n\n{json.dumps(meta)}\n")
    print(text)
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
