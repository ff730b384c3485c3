"""Quality against bytes: leapctl's compressed models beside llama.cpp's quantized files of the same weights,
in one table and one PNG.

leapctl points: `leapctl compress MODEL --sparsity S --keep-stages` for each sparsity, every stage that holds
a model scored (Wanda, recovered 16-bit values, 4-bit), perplexity by `leapctl eval`, bytes read per
decoded token counted from each point's export (bitmap for 16-bit values, bitmap-q4 for 4-bit ones).
llama.cpp points (when `make bench-setup` has built its venv): the dense model converted to an F32 GGUF by
llama.cpp's own converter, each type made by its own quantizer, perplexity from its own logits
(llama-cpp-python) over the same windows of its own tokens, bytes counted from the GGUF's tensors (every
matrix and the output projection). The text is WikiText-2's test split, its first 60,000 characters, in
512-token windows, as issue #42's table.

    python -m bench.pareto --sparsities 0.3 0.4 0.5 0.6 --budget 35    # SmolLM2-135M: ~3 h on 2 cores
    python -m bench.pareto --sparsities 0.5 --reuse runs/pareto       # add points to an earlier run
    python -m bench.pareto --sparsities --runs "wanda 50%=runs/w50" "recovered=runs/r50"   # given runs
    python -m bench.pareto --sparsities --runs "60% 4-bit=c60" --carry OLD.json  # + old points

`--carry` keeps the points of an earlier results file that this run does not measure (the run folders behind
them may be gone), marked in the table. Perplexity does not depend on the machine, so this run's dense
perplexity must equal the earlier file's, or the carried points are refused.
Writes bench/results/pareto/pareto_<name>.{md,json,png}; the notes under an earlier table of the same name are
kept."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.competitors import BENCH_VENV, GGUF_FTYPES, REPO, write_gguf
from leapctl.compress.config import WIKITEXT2_CHARACTERS, WIKITEXT2_RAW
from leapctl.compress.report import bytes_per_weight
from leapctl.paths import assets_dir

RESULTS = REPO / "bench" / "results" / "pareto"
LLAMA_CPP_TYPES = ("q8_0", "q5_0", "q4_1", "q4_0", "iq4_nl", "q4_k_m", "q3_k_m", "q2_k")
SEQ_LEN = 512
# Carried points share the table only when the two runs' dense perplexities agree within this (relative): a
# 0.05% change of the dense moves no x-dense ratio of the table's three decimals by more than one in the last.
CARRY_TOLERANCE = 5e-4
NOTES_MARK = "<!-- notes: what follows is written by hand and kept when bench.pareto rewrites this file -->"

# llama.cpp's perplexity of a GGUF, run by the bench venv's Python: argv GGUF, text file, window, threads.
_LLAMA_CPP_PPL = """
import json, sys
import numpy as np
import llama_cpp
gguf, text, window, threads = sys.argv[1], open(sys.argv[2]).read(), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=gguf, n_ctx=window, logits_all=True, n_threads=threads, verbose=False)
tokens = llm.tokenize(text.encode(), add_bos=True)
nll, count = 0.0, 0
for start in range(0, len(tokens) - window + 1, window):
    ids = tokens[start:start + window]
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[:window], dtype=np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll -= logp[np.arange(window - 1), ids[1:]].sum()
    count += window - 1
print(json.dumps({"ppl": float(np.exp(nll / count)), "tokens": count}))
"""
# Bytes per weight of a GGUF's matrices (every 2-D tensor but the token table, plus the output projection,
# which a tied model reads from the token table): gguf-py's reader, run by the main venv with its path.
_GGUF_BYTES = """
import json, sys
from gguf import GGUFReader
tensors = GGUFReader(sys.argv[1]).tensors
embed = next(t for t in tensors if t.name == "token_embd.weight")
matrices = [t for t in tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
has_output = any(t.name == "output.weight" for t in matrices)
read = sum(int(t.n_bytes) for t in matrices) + (0 if has_output else int(embed.n_bytes))
weights = sum(int(t.n_elements) for t in matrices) + (0 if has_output else int(embed.n_elements))
types = sorted({t.tensor_type.name for t in matrices + ([] if has_output else [embed])})
print(json.dumps({"per_weight": read / weights, "types": types}))
"""


def leapctl(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "leapctl", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"leapctl {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def wikitext_excerpt(work: Path) -> Path:
    assets = assets_dir()
    if assets is None or not (assets / WIKITEXT2_RAW).is_file():
        raise SystemExit(f"{WIKITEXT2_RAW} needs ../shared/assets (or $LEAPCTL_ASSETS)")
    path = work / "wikitext2-60k.txt"
    path.write_text((assets / WIKITEXT2_RAW).read_text()[:WIKITEXT2_CHARACTERS])
    return path


def leapctl_points(args, work: Path, text: Path) -> list[dict]:
    """Every stage of a compress run per sparsity, and every run folder given as `--runs NAME=RUN`:
    perplexity and bytes per weight."""
    points = [_run_point(name, Path(run), work) for name, run in (item.split("=", 1) for item in args.runs)]
    for sparsity in args.sparsities:
        out = work / f"compress-{sparsity}"
        if not out.is_dir():
            started = time.monotonic()
            leapctl("compress", args.model, "--sparsity", str(sparsity), "--budget", args.budget, "--stages",
                    args.stages, "--keep-stages", "--no-evaluate", "--out", str(out), "--no-progress")
            print(f"compress {sparsity}: {time.monotonic() - started:.0f} s", flush=True)
        state = out.with_name(out.name + ".compress-state")
        for stage in ("prune", "learn", "recover", "quantize"):
            run = state / stage
            if not run.is_dir():
                continue
            fmt = "bitmap-q4" if stage == "quantize" else "bitmap"
            export = work / f"export-{sparsity}-{stage}"
            if not export.is_dir():
                leapctl("export", str(run), "--format", fmt, "--out", str(export))
            points.append({"name": f"leapctl {sparsity:.0%} {stage}", "family": "leapctl",
                           "sparsity": sparsity, "stage": stage, "format": fmt, "run": str(run),
                           "per_weight": bytes_per_weight(export, run)["per_weight"]})
    runs = [args.model] + [p["run"] for p in points]
    eval_json = work / "eval.json"
    leapctl("eval", *runs, "--ppl", str(text), "--seq-len", str(SEQ_LEN), "--json", str(eval_json),
            "--no-progress")
    scores = json.loads(eval_json.read_text())["models"]
    dense = {"name": "dense (fp32)", "family": "dense", "per_weight": 4.0,
             "ppl": scores[0]["perplexity"][text.name]["ppl"]}
    for point, score in zip(points, scores[1:], strict=True):
        point["ppl"] = score["perplexity"][text.name]["ppl"]
    return [dense, *points]


def _run_point(name: str, run: Path, work: Path) -> dict:
    """A run folder made outside this script (any leapctl pipeline), exported to count its bytes."""
    quantized = (run / "leapctl" / "scales.safetensors").is_file()
    fmt = "bitmap-q4" if quantized else "bitmap"
    export = work / f"export-{name}"
    if not export.is_dir():
        leapctl("export", str(run), "--format", fmt, "--out", str(export))
    return {"name": f"leapctl {name}", "family": "leapctl", "format": fmt, "run": str(run),
            "per_weight": bytes_per_weight(export, run)["per_weight"]}


def llama_cpp_points(args, work: Path, text: Path) -> list[dict]:
    """llama.cpp's F32 GGUF and each quantized type: its perplexity and bytes per weight."""
    if not (BENCH_VENV / "bin" / "python").is_file():
        print(f"no {BENCH_VENV} (make bench-setup): llama.cpp points skipped", flush=True)
        return []
    from leapctl.models import resolve_model

    model_dir = resolve_model(args.model)
    points = []
    for kind in ("f32", *args.llama_cpp_types):
        gguf = write_gguf(model_dir, work / f"model.{kind}.gguf", kind, base="f32")
        ppl = json.loads(_bench_python(_LLAMA_CPP_PPL, str(gguf), str(text), str(SEQ_LEN), "2"))
        size = json.loads(subprocess.run(
            [sys.executable, "-c", _GGUF_BYTES, str(gguf)], capture_output=True, text=True, check=True,
            env={"PYTHONPATH": str(BENCH_VENV / "llama.cpp" / "gguf-py")}).stdout)
        points.append({"name": f"llama.cpp {kind.upper()}", "family": "llama.cpp", "ppl": ppl["ppl"],
                       "per_weight": size["per_weight"], "types": size["types"]})
    return points


def _bench_python(code: str, *argv: str) -> str:
    done = subprocess.run([str(BENCH_VENV / "bin" / "python"), "-c", code, *argv], capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"llama.cpp scoring failed: {done.stderr[-2000:]}")
    return done.stdout


def carried_points(path: Path, measured: list[dict]) -> list[dict]:
    """The points of an earlier results file that `measured` does not hold (by name), each marked with the
    run that scored it; refused when the two runs' dense perplexities differ (another text or scorer)."""
    earlier = json.loads(path.read_text())
    dense = next(p["ppl"] for p in measured if p["family"] == "dense")
    earlier_dense = next(p["ppl"] for p in earlier["points"] if p["family"] == "dense")
    if abs(dense / earlier_dense - 1) > CARRY_TOLERANCE:
        raise SystemExit(f"--carry {path}: its dense perplexity {earlier_dense:.4f} is not this run's "
                         f"{dense:.4f}; its points were scored on other tokens and cannot share the table")
    names = {p["name"] for p in measured}
    source = f"`{earlier['command']}` ({earlier.get('date', 'date not recorded')})"
    return [{**point, "carried_from": point.get("carried_from", source)} for point in earlier["points"]
            if point["family"] != "dense" and point["name"] not in names]


def write_results(points: list[dict], name: str, command: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    md = RESULTS / f"pareto_{name}.md"
    notes = md.read_text().partition(NOTES_MARK)[2] if md.is_file() else ""
    dense = next(p["ppl"] for p in points if p["family"] == "dense")
    f32 = next((p["ppl"] for p in points if p["name"] == "llama.cpp F32"), None)
    date = time.strftime("%Y-%m-%d")
    sources = sorted({p["carried_from"] for p in points if "carried_from" in p})
    lines = [f"`{command}` ({date})", "",
             "| model file | bytes read a token, per weight | WikiText-2 ppl (60k chars, 512) | x dense |",
             "| --- | --- | --- | --- |"]
    for point in sorted(points, key=lambda p: -p["per_weight"]):
        base = f32 if point["family"] == "llama.cpp" and f32 else dense
        point["x_dense"] = point["ppl"] / base
        types = f" ({', '.join(point['types'])})" if point.get("types") else ""
        mark = "*" * (sources.index(point["carried_from"]) + 1) if "carried_from" in point else ""
        lines.append(f"| {point['name']}{types}{mark} | {point['per_weight']:.3f} | {point['ppl']:.2f} | "
                     f"{point['x_dense']:.3f} |")
    for index, source in enumerate(sources, 1):
        lines += ["", f"{'*' * index} Not scored in this run: carried from {source}."]
    md.write_text("\n".join([*lines, "", NOTES_MARK]) + (notes or "\n"))
    (RESULTS / f"pareto_{name}.json").write_text(
        json.dumps({"command": command, "date": date, "points": points}, indent=2))
    plot(points, RESULTS / f"pareto_{name}.png", name)


def plot(points: list[dict], path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    # leapctl's labels below left of their points, llama.cpp's to the right: the 4-bit points of the two
    # sit side by side within a few hundredths of a byte; a log axis gives the 0.5-0.8 bytes room beside
    # the 16-bit points. The dense model (4 bytes) is the line at 1.
    styles = {"llama.cpp": ("tab:orange", "s", (4, -3), "left"),
              "leapctl": ("tab:blue", "o", (-5, -10), "right")}
    for family, (color, marker, offset, align) in styles.items():
        chosen = [p for p in points if p["family"] == family and p["per_weight"] < 2.5]
        ax.scatter([p["per_weight"] for p in chosen], [p["x_dense"] for p in chosen], color=color,
                   marker=marker, label=family)
        for p in chosen:
            ax.annotate(p["name"].removeprefix(f"{family} "), (p["per_weight"], p["x_dense"]), fontsize=7,
                        xytext=offset, textcoords="offset points", ha=align)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="dense (fp32, 4 bytes)")
    ax.set_xscale("log")
    ticks = [0.5, 0.6, 0.7, 0.8, 1.0, 1.5, 2.0, 2.5]
    ax.set_xticks(ticks, labels=[f"{tick:g}" for tick in ticks])
    ax.set_xlim(0.3, 2.8)  # room for the labels left of the smallest points (60% + 4-bit: 0.44)
    ax.minorticks_off()
    ax.set_xlabel("bytes read per decoded token, per weight (matrices + lm_head; log scale)")
    ax.set_ylabel("WikiText-2 perplexity / dense")
    ax.set_title(f"{name}: quality against bytes")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="smollm2-135m")
    parser.add_argument("--sparsities", type=float, nargs="*", default=[0.3, 0.4, 0.5, 0.6])
    parser.add_argument("--runs", nargs="*", default=[], metavar="NAME=RUN",
                        help="run folders made elsewhere to put on the chart (e.g. the stages of a study)")
    parser.add_argument("--budget", default="auto", help="compress --budget of every sparsity")
    parser.add_argument("--stages", default="prune,recover,quantize")
    parser.add_argument("--llama-cpp-types", nargs="*", default=list(LLAMA_CPP_TYPES),
                        choices=sorted(GGUF_FTYPES))
    parser.add_argument("--reuse", type=Path, default=REPO / "runs" / "pareto", help="work folder")
    parser.add_argument("--carry", type=Path, metavar="JSON",
                        help="an earlier results file whose points this run does not measure")
    args = parser.parse_args()
    if args.carry and not args.carry.is_file():
        raise SystemExit(f"--carry {args.carry}: no such file")
    args.reuse.mkdir(parents=True, exist_ok=True)
    text = wikitext_excerpt(args.reuse)
    points = leapctl_points(args, args.reuse, text) + llama_cpp_points(args, args.reuse, text)
    if args.carry:
        points += carried_points(args.carry, points)
    write_results(points, args.name, "python -m bench.pareto " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
