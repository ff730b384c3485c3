"""Issue 44's fuzz suite: every command on a seeded, generated corpus of broken inputs (truncated and
bit-flipped safetensors, malformed and wrong-typed JSON in run reports, manifests, configs and mask
metadata, wrong shapes, out-of-range and non-finite numbers on the command line and in `--config FILE`,
outputs that cannot be written). Each case runs in a process of its own, as `leapctl` runs: no traceback,
one error line and exit 2 (exit 1 for a validation that ran and found the damage), no file written outside
the case's own folder, the inputs unchanged.

The cases are forked from one driver process that has imported leapctl once (a fresh interpreter per case
costs ~3 s of imports, which would take the suite far past its minute): each child runs `leapctl.cli.main`
with its own arguments, working folder, stdout and stderr, and an exception that escaped `main` is printed
and ends the child with 1, as the interpreter does for the console script."""

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_export import pruned_run  # noqa: F401  (a fixture)

SEED = 44
DRIVER = """
import json, os, sys, traceback
from leapctl.cli import main
cases, logs = json.loads(open(sys.argv[1]).read()), sys.argv[2]
results = {}
for case in cases:
    err, out = os.path.join(logs, case["name"] + ".err"), os.path.join(logs, case["name"] + ".out")
    pid = os.fork()
    if pid == 0:
        os.chdir(case["cwd"])
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
        sys.argv = ["leapctl", *case["args"]]
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    results[case["name"]] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(results))
"""


def digest(folder: Path) -> dict[str, str]:
    """Every path under `folder` (folders too) with its content's sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


# ------------------------------------------------------------------ damage, drawn from one seeded generator


def truncate(rng: random.Random, path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:rng.randrange(1, len(data) - 1)])


def garble_header(rng: random.Random, path: Path) -> None:
    """A safetensors file whose JSON header is replaced by random bytes of the same length."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    path.write_bytes(data[:8] + bytes(rng.randrange(256) for _ in range(length)) + data[8 + length:])


def flip_bit(rng: random.Random, path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


WRONG_VALUES = [5, -1, 2.5, True, None, "text", [], [1, "a"], {}, {"x": 1}]


def bad_json_text(rng: random.Random, valid: str) -> str:
    """Not a JSON object: cut short, a list, a number, random characters."""
    return rng.choice([valid[:rng.randrange(1, len(valid) - 1)], "[1, 2]", "17", "null",
                       "".join(chr(rng.randrange(32, 127)) for _ in range(40))])


def mask_metadata_damage(rng: random.Random, meta: dict) -> dict:
    shapes = json.loads(meta["shapes"])
    name = rng.choice(sorted(shapes))
    edits = [("shapes", None), ("shapes", "garbage"), ("shapes", "[1, 2]"), ("extra", "{"),
             ("shapes", json.dumps({**shapes, name: [1, 2, 3]})),
             ("shapes", json.dumps({**shapes, name: ["a", "b"]})),
             ("shapes", json.dumps({**shapes, name: [-1, shapes[name][1]]})),
             ("shapes", json.dumps({**shapes, name: [shapes[name][0], shapes[name][1] + 8]})),
             ("format", "something else")]
    key, value = rng.choice(edits)
    return {k: v for k, v in {**meta, key: value}.items() if v is not None}


MANIFEST_KEYS = ["format", "source", "masks", "files", "layers", "dense_tensors", "weight_files"]


def manifest_damage(rng: random.Random, manifest: dict) -> None:
    kind = rng.randrange(4)
    if kind == 0:
        manifest.pop(rng.choice(MANIFEST_KEYS))
    elif kind == 1:
        key = rng.choice(MANIFEST_KEYS)
        manifest[key] = rng.choice([v for v in WRONG_VALUES if type(v) is not type(manifest[key])])
    elif kind == 2:
        manifest["files"][rng.choice(sorted(manifest["files"]))] = rng.choice([5, "x", [], None])
    else:
        entry = manifest["files"][rng.choice(sorted(manifest["files"]))]
        entry.pop(rng.choice(["bytes", "sha256"]))


def config_damage(rng: random.Random, config: dict) -> str:
    """A config.json that builds no model of the stored weights (re-hashed into the manifest)."""
    return rng.choice(["garbage", "[1]", json.dumps({k: v for k, v in config.items()
                                                     if k != "num_attention_heads"}),
                       json.dumps({**config, "num_attention_heads": rng.choice([0, -2, "8", 3])}),
                       json.dumps({**config, "quantization_config": rng.choice([5, "x", []])})])


# ------------------------------------------------------------------ the corpus


class Corpus:
    """Builds the cases: each gets a folder (its working folder and the only place it may write) and its
    own damaged copies of the inputs there under `input-*` (checked unchanged afterwards)."""

    def __init__(self, root: Path, run: Path, export: Path, model: Path):
        self.root, self.run, self.export, self.model = root, run, export, model
        self.rng = random.Random(SEED)
        self.cases: list[dict] = []

    def case(self, name: str, expected: tuple[int, ...] = (2,)) -> Path:
        folder = self.root / "cases" / name
        folder.mkdir(parents=True)
        self.cases.append({"name": name, "cwd": str(folder), "args": [], "expected": expected})
        return folder

    def add(self, name: str, *args, expected: tuple[int, ...] = (2,)) -> Path:
        folder = self.case(name, expected)
        self.cases[-1]["args"] = [str(a) for a in args]
        return folder

    def copy(self, source: Path, folder: Path, name: str) -> Path:
        return shutil.copytree(source, folder / name) if source.is_dir() else Path(shutil.copy(source,
                                                                                               folder / name))


def damaged_run_cases(c: Corpus) -> None:
    """Truncated / header-garbled weights and mask files, run reports that are no JSON object."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from leapctl.runs import MASKS_FILE

    for i in range(3):
        folder = c.case(f"export-weights-{i}")
        run = c.copy(c.run, folder, "input-run")
        (truncate if i % 2 == 0 else garble_header)(c.rng, run / "model.safetensors")
        fmt = c.rng.choice(["bitmap", "csr"])
        c.cases[-1]["args"] = ["export", str(run), "--format", fmt, "--out", "out"]
    for i in range(2):
        folder = c.case(f"apply-mask-file-{i}")
        masks = c.copy(c.run / MASKS_FILE, folder, "input-masks.safetensors")
        (truncate if i == 0 else garble_header)(c.rng, masks)
        c.cases[-1]["args"] = ["apply-mask", str(c.model), str(masks), "--out", "out"]
    with safe_open(str(c.run / MASKS_FILE), framework="pt") as handle:
        meta = handle.metadata()
    tensors = load_file(str(c.run / MASKS_FILE))
    for i in range(4):
        folder = c.case(f"mask-metadata-{i}")
        masks = folder / "input-masks.safetensors"
        save_file(tensors, str(masks), metadata=mask_metadata_damage(c.rng, meta))
        command = (["apply-mask", str(c.model), str(masks)] if i % 2 == 0
                   else ["export", str(c.model), "--masks", str(masks), "--format", "bitmap"])
        c.cases[-1]["args"] = [*command, "--out", "out"]
    for i, command in enumerate(["export", "quantize", "export"]):
        folder = c.case(f"report-{i}")
        run = c.copy(c.run, folder, "input-run")
        (run / "report.json").write_text(bad_json_text(c.rng, (c.run / "report.json").read_text()))
        extra = ["--format", "bitmap"] if command == "export" else ["--method", "rtn", "--tune-steps", "0"]
        c.cases[-1]["args"] = [command, str(run), *extra, "--out", "out"]


def damaged_export_cases(c: Corpus) -> None:
    """Flipped bits in listed files, damaged manifests, re-hashed configs that build no model."""
    from leapctl.exporters.base import sha256_file

    for i in range(2):
        folder = c.case(f"validate-flip-{i}", expected=(1,))
        export = c.copy(c.export, folder, "input-export")
        flip_bit(c.rng, export / c.rng.choice(["model.safetensors", "config.json", "tokenizer.json"]))
        c.cases[-1]["args"] = ["validate", str(export), "--no-end-to-end"]
    for i in range(4):
        command = ["validate", "--no-end-to-end"] if i % 2 == 0 else ["serve", "--port", "1"]
        folder = c.case(f"manifest-{i}")
        export = c.copy(c.export, folder, "input-export")
        manifest = json.loads((export / "manifest.json").read_text())
        manifest_damage(c.rng, manifest)
        (export / "manifest.json").write_text(json.dumps(manifest))
        c.cases[-1]["args"] = [command[0], str(export), *command[1:]]
    manifest_text = (c.export / "manifest.json").read_text()
    folder = c.case("manifest-not-json")
    export = c.copy(c.export, folder, "input-export")
    (export / "manifest.json").write_text(bad_json_text(c.rng, manifest_text))
    c.cases[-1]["args"] = ["validate", str(export)]
    for i in range(3):
        validating = i < 2
        folder = c.case(f"export-config-{i}", expected=(1,) if validating else (2,))
        export = c.copy(c.export, folder, "input-export")
        (export / "config.json").write_text(config_damage(c.rng, json.loads((c.export / "config.json")
                                                                            .read_text())))
        manifest = json.loads(manifest_text)
        manifest["files"]["config.json"] = {"sha256": sha256_file(export / "config.json"),
                                            "bytes": (export / "config.json").stat().st_size}
        (export / "manifest.json").write_text(json.dumps(manifest))
        c.cases[-1]["args"] = (["validate", str(export), "--max-new-tokens", "1"] if validating
                               else ["serve", str(export), "--port", "1"])


def number_cases(c: Corpus) -> None:
    """Out-of-range and non-finite numbers on the command line."""
    prune = ["prune", c.model, "--method", "wanda", "--out", "out", "--sparsity"]
    choices = [
        [*prune, c.rng.choice(["nan", "inf", "-inf", "0", "1", "-0.5", "1.5"])],
        [*prune, "0.5", "--nsamples", c.rng.choice(["0", "-3"])],
        [*prune, "0.5", "--seq-len", c.rng.choice(["1", "-7"])],
        ["validate", c.export, "--max-new-tokens", c.rng.choice(["0", "-5"])],
        ["serve", c.export, "--port", c.rng.choice(["0", "-1", "70000"])],
        ["serve", c.export, "-tp", c.rng.choice(["0", "-2"])],
        ["learn", c.model, "--sparsity", "0.5", "--out", "out", "--lr", c.rng.choice(["nan", "inf", "0"])],
        ["recover", c.run, "--out", "out", "--lr", c.rng.choice(["nan", "-inf"])],
        ["export", c.run, "--format", "bitmap", "--out", "out", "--max-shard-size",
         c.rng.choice(["0", "-1", "x"])],
        ["eval", c.run, "--seq-len", c.rng.choice(["-5", "1"])],
        ["quantize", c.run, "--out", "out", "--group-size", c.rng.choice(["0", "-64", "33"])],
    ]
    for i, args in enumerate(choices):
        c.add(f"number-{i}", *args)


def config_file_cases(c: Corpus) -> None:
    """`--config FILE`: wrong types, non-finite and out-of-range values, unknown keys, broken syntax."""
    commands = {
        "prune": (["prune", c.model, "--method", "wanda", "--sparsity", "0.5", "--out", "out"],
                  {"nsamples": True, "seq_len": "64", "sparsity": float("nan"), "include": 5, "calib": []}),
        "serve": (["serve", c.export], {"port": 70000, "host": 5, "tensor_parallel_size": 0}),
        "learn": (["learn", c.model, "--sparsity", "0.5", "--out", "out"],
                  {"lr": float("inf"), "steps": 2.5, "beta1": "x"}),
        "eval": (["eval", c.run], {"ppl": ["a", 3], "batch_size": False, "seq_len": [64]}),
    }
    for name, (args, wrong) in sorted(commands.items()):
        key = c.rng.choice(sorted(wrong))
        folder = c.add(f"config-{name}", *args, "--config", "settings.json")
        text = json.dumps({key: wrong[key]})  # json writes nan and inf as NaN and Infinity
        (folder / "settings.json").write_text(text)
    for i, text in enumerate(["nsamples = ", "[1, 2]", '{"no_such_setting": 1}']):
        folder = c.add(f"config-syntax-{i}", "prune", c.model, "--method", "wanda", "--sparsity", "0.5",
                       "--out", "out", "--config", "settings.toml" if i == 0 else "settings.json")
        (folder / ("settings.toml" if i == 0 else "settings.json")).write_text(text)


def output_cases(c: Corpus) -> None:
    """Outputs under a regular file, on an existing file, in a folder leapctl did not write."""
    commands = [["prune", c.model, "--method", "magnitude", "--sparsity", "0.5", "--out"],
                ["export", c.run, "--format", "bitmap", "--out"],
                ["apply-mask", c.model, c.run, "--out"],
                ["quantize", c.run, "--method", "rtn", "--tune-steps", "0", "--out"],
                ["eval", c.run, "--ppl", c.root / "text.txt", "--seq-len", "32", "--json"]]
    for i, command in enumerate(commands):
        place = c.rng.choice(["under a file", "a file", "a stranger's folder"])
        folder = c.case(f"output-{i}")
        (folder / "notes.txt").write_text("mine")
        (folder / "mine").mkdir()
        (folder / "mine" / "a.txt").write_text("mine")
        if command[0] == "eval" and place == "a stranger's folder":
            place = "under a file"  # a folder is refused as --json whatever it holds
        target = {"under a file": folder / "notes.txt" / "out", "a file": folder / "notes.txt",
                  "a stranger's folder": folder / "mine"}[place]
        c.cases[-1]["args"] = [str(a) for a in [*command, target]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, pruned_run, stories260k_dir, tinystories_text) -> Corpus:  # noqa: F811
    from leapctl.commands.export import export

    root = tmp_path_factory.mktemp("fuzz")
    export(str(pruned_run), "bitmap", root / "export")
    (root / "text.txt").write_text(tinystories_text[:4000])
    c = Corpus(root, pruned_run, root / "export", stories260k_dir)
    for build in (damaged_run_cases, damaged_export_cases, number_cases, config_file_cases, output_cases):
        build(c)
    return c


def test_no_broken_input_gets_a_traceback_a_stray_file_or_a_changed_input(corpus):
    """Every case: its expected exit status, no traceback, one `error:` line when it exits 2; nothing
    written outside its folder (the case folders' inputs and the shared ones unchanged)."""
    from leapctl.paths import cache_dir

    root = corpus.root
    shared = {name: digest(path) for name, path in (("run", corpus.run), ("export", corpus.export))}
    inputs = {case["name"]: digest(Path(case["cwd"])) for case in corpus.cases}
    top = sorted(p.name for p in root.iterdir())
    tracebacks = cache_dir() / "tracebacks"
    before = sorted(tracebacks.iterdir()) if tracebacks.is_dir() else []
    logs = root.parent / f"{root.name}-logs"
    logs.mkdir()
    (logs / "cases.json").write_text(json.dumps(corpus.cases))
    done = subprocess.run([sys.executable, "-c", DRIVER, str(logs / "cases.json"), str(logs)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = json.loads(done.stdout.strip().splitlines()[-1])
    problems = []
    for case in corpus.cases:
        name, folder = case["name"], Path(case["cwd"])
        stderr = (logs / f"{name}.err").read_text()
        lines = [line for line in stderr.splitlines() if line.strip()]
        if statuses[name] not in case["expected"]:
            problems.append(f"{name}: exit {statuses[name]}, expected {case['expected']}: {case['args']}")
        one_line = len(lines) == 1 and lines[0].startswith("error: ")
        if "Traceback" in stderr or (statuses[name] == 2 and not one_line):
            problems.append(f"{name}: not one error line: {stderr[-1500:]}")
        if digest(folder) != inputs[name]:
            problems.append(f"{name}: changed or wrote files in its folder: {sorted(digest(folder))}")
    assert not problems, "\n".join(problems)
    assert {name: digest(path) for name, path in (("run", corpus.run), ("export", corpus.export))} == shared
    assert sorted(p.name for p in root.iterdir()) == top
    assert (sorted(tracebacks.iterdir()) if tracebacks.is_dir() else []) == before
