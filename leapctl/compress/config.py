"""Every setting of `leapctl compress`, declared once; the CLI is generated from it."""

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from leapctl.compute import DEVICE_HELP
from leapctl.errors import LeapctlError
from leapctl.masks import check_sparsity
from leapctl.quantize.config import LM_HEAD_BITS
from leapctl.settings import setting

# The pipeline's stages in the order they run; `--stages` picks a subset (prune always runs: it is the start).
PRUNE, LEARN, RECOVER, QUANTIZE = "prune", "learn", "recover", "quantize"
STAGES = (PRUNE, LEARN, RECOVER, QUANTIZE)
DEFAULT_STAGES = "prune,recover,quantize"
AUTO = "auto"
# The and bench/pareto's WikiText-2 text: its test split's first 60,000 characters (15,227 SmolLM2
# tokens), scored the same way for every model.
WIKITEXT2_RAW, WIKITEXT2_CHARACTERS = "wikitext-2-raw/wiki.test.raw", 60_000
# The texts compress writes into its state folder and scores itself: wiki-summaries' held-apart slice and
# that WikiText-2 excerpt (eval keys scores by file name, so --eval-text may not reuse them).
HELDOUT_NAME, WIKITEXT2_NAME = "wiki-summaries-heldout.txt", f"wikitext2-{WIKITEXT2_CHARACTERS // 1000}k.txt"
OWN_TEXT_NAMES = (HELDOUT_NAME, WIKITEXT2_NAME)
_TOKEN_UNITS = {"tok": 1, "tokens": 1, "ktok": 1_000, "ktokens": 1_000, "Mtok": 1_000_000,
                "Mtokens": 1_000_000}
_UNITS = "|".join(("min", "h", *_TOKEN_UNITS))
_BUDGET = re.compile(rf"^\s*(?P<number>[0-9]*\.?[0-9]+)\s*(?P<unit>{_UNITS})?\s*$")


@dataclass(frozen=True)
class Budget:
    """What the training stages may spend: wall-clock minutes (the plan converts them into steps from a
    measured step time) or training tokens (steps follow directly)."""

    minutes: float | None = None
    tokens: int | None = None

    def __str__(self) -> str:
        return f"{self.minutes:g} min" if self.minutes is not None else f"{self.tokens:,} tokens"


def parse_budget(text: str) -> Budget:
    """`45`, `45min`, `1.5h` (minutes) or `300ktok`, `2Mtok`, `250000tokens` (training tokens)."""
    found = _BUDGET.match(text)
    if not found:
        raise LeapctlError(f"--budget {text!r} is neither minutes (45, 45min, 1.5h) nor tokens (300ktok, "
                           f"2Mtok)")
    number, unit = float(found["number"]), found["unit"] or "min"
    if not (math.isfinite(number) and number > 0):
        raise LeapctlError(f"--budget must be more than 0, got {text!r}")
    if unit in _TOKEN_UNITS:
        return Budget(tokens=int(number * _TOKEN_UNITS[unit]))
    return Budget(minutes=number * 60 if unit == "h" else number)


def parse_stages(text: str) -> tuple[str, ...]:
    """The stages named (comma-separated) in the order named, prune always first. learn comes before
    recover and quantize (it learns the mask of the dense weights); recover after quantize trains the kept
    weights on the 4-bit grid (quantization-aware recovery)."""
    named = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in named if name not in STAGES]
    if unknown:
        raise LeapctlError(f"unknown stage {unknown[0]!r} in --stages (choose from {', '.join(STAGES)})")
    twice = [name for name in named if named.count(name) > 1]
    if twice:
        raise LeapctlError(f"stage {twice[0]!r} is named twice in --stages")
    stages = (PRUNE, *(name for name in named if name != PRUNE))
    if LEARN in stages and stages.index(LEARN) != 1:
        raise LeapctlError("--stages: learn comes right after prune (it learns the mask of dense weights)")
    return stages


@dataclass
class CompressConfig:
    model: str = setting(help="Local Hugging Face folder, hub id, or built-in name (smollm2-135m).",
                         argument=True, metavar="MODEL")
    sparsity: float = setting(help="Fraction of the decoder's linear weights pruned, in (0, 1). On "
                                   "SmolLM2-135M at the CPU budget 0.3 is smaller and better than "
                                   "llama.cpp's Q4_0 (0.84x its bytes a token, 0.93x its WikiText-2 "
                                   "perplexity); 0.5 reads fewer bytes at 1.6x the dense perplexity "
                                   "(bench/results/compress).")
    out: Path = setting(help="Output run folder: the compressed model (4-bit kept weights unless quantize is "
                             "left out), its masks, scales and report, plus compress.json.")
    budget: str = setting(AUTO, "What training may spend: minutes (45, 45min, 1.5h) or tokens (300ktok, "
                                "2Mtok). auto: 35 minutes on a CPU (SmolLM2-135M's whole pipeline within "
                                "45 on two cores), 20M tokens on a GPU.")
    stages: str = setting(DEFAULT_STAGES, "Stages to run, in the order named (prune always first): prune "
                                          "(Wanda), learn (LEAP from the Wanda mask), recover (kept weights "
                                          "by distillation; after quantize, on the 4-bit grid), quantize "
                                          "(4-bit GPTQ, + scale tuning when it is the last stage). The "
                                          "default is the order measured best at the CPU budget "
                                          "(bench/results/compress).")
    lm_head_bits: int = setting(4, "Bits of lm_head's weights in the quantize stage: 4 (GPTQ, untied from "
                                   "the input embedding, which keeps its values) or 8 (int8 rows). On "
                                   "SmolLM2-135M at 30%, 4 bits read 0.89x the bytes of 8 for +1.1% "
                                   "WikiText-2 perplexity (bench/results/compress).")
    calib: str = setting("wiki-summaries", "Calibration and training text: file, folder, .jsonl, saved "
                                           "dataset, wiki-summaries or generated.")
    eval_text: list[str] = setting(default_factory=list, help="Extra text files to score dense against "
                                                              "compressed on (for example WikiText-2's test "
                                                              "split); wiki-summaries' held-apart slice is "
                                                              "always scored when it is the calibration.",
                                   metavar="FILE")
    evaluate: bool = setting(True, "Score dense against compressed at the end (perplexity table).")
    keep_stages: bool = setting(False, "Keep each stage's run folder in OUT.compress-state after success.")
    device: str = setting(AUTO, f"Where to work: {DEVICE_HELP}.")
    seed: int = setting(0, "Seed of every stage.")
    overwrite: bool = setting(False, "Replace a non-empty output folder (and start over).",
                              flag="--overwrite")
    progress: bool = setting(True, "Show progress bars.")
    stage_list: tuple[str, ...] = field(default=(), metadata={"cli": False})

    def validate(self) -> None:
        """One clear error for settings that cannot work, before any model loads."""
        check_sparsity(self.sparsity)
        if self.lm_head_bits not in LM_HEAD_BITS or self.lm_head_bits == 16:
            raise LeapctlError(f"--lm-head-bits {self.lm_head_bits} is not supported by compress (4 or 8)")
        if self.budget != AUTO:
            parse_budget(self.budget)
        self.stage_list = parse_stages(self.stages)
        names: set[str] = set()  # the scores are keyed by file name
        for text in self.eval_text:
            name = Path(text).name
            if not Path(text).is_file():
                raise LeapctlError(f"--eval-text {text} is not a file")
            if name in OWN_TEXT_NAMES:
                raise LeapctlError(f"--eval-text {text}: compress names its own texts "
                                   f"{' and '.join(OWN_TEXT_NAMES)} (scores are keyed by file name); "
                                   f"rename it")
            if name in names:
                raise LeapctlError(f"--eval-text {text}: another --eval-text is also named {name} (scores "
                                   f"are keyed by file name); rename one")
            names.add(name)

    def state_dir(self) -> Path:
        out = Path(self.out)
        return out.with_name(f"{out.name}.compress-state")
