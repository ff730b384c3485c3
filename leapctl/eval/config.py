"""Every setting of `leapctl eval`, declared once; the CLI is generated from it."""

from dataclasses import dataclass
from pathlib import Path

from leapctl.compute import DEVICE_HELP, DTYPES
from leapctl.settings import setting


@dataclass
class EvalConfig:
    models: list[str] = setting(help="Local HF folders (run folders of prune/learn), hub ids or built-in "
                                     "names; evaluated one after another.", argument=True, metavar="MODEL...")
    ppl: list[str] = setting(help="Perplexity text: a file (repeatable) or 'wikitext2' (WikiText-2 test "
                                  "from the shared assets). Default: wikitext2 when no --tasks are given.",
                             default_factory=list)
    seq_len: int | None = setting(None, "Perplexity window; default the model's context capped at 4096.")
    tasks: str = setting("", "Zero-shot tasks, comma-separated: piqa,winogrande,hellaswag.")
    limit: int | None = setting(None, "Only the first N items of each task.")
    tasks_dir: Path | None = setting(None, "Folder with piqa/, winogrande/, hellaswag/; default the shared "
                                           "assets.")
    json_out: Path | None = setting(None, "Write the results as JSON here (an earlier eval result there is "
                                          "replaced; another file only with --overwrite).", flag="--json")
    overwrite: bool = setting(False, "Let --json replace a file that is not an earlier eval result (never "
                                     "one of this command's inputs).", flag="--overwrite")
    device: str = setting("auto", f"{DEVICE_HELP}.")
    dtype: str = setting("float32", f"{', '.join(DTYPES)}.")
    batch_size: int = setting(1, "Perplexity windows per forward pass.")
    progress: bool = setting(True, "Show progress bars.")
