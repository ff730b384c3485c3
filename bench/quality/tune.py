"""What `quantize`'s end-to-end scale tuning buys on a quantized run folder that exists already, at a batch
and window length of your choosing (quantize's own defaults, 8 x 512 tokens a step, take hours on a CPU for
SmolLM2): perplexity before and after `leapctl.quantize.tune.tune_scales`, nothing written.

    python -m bench.quality tune "runs/quality_q4/smollm2-135m-0.5/leap + gptq" --teacher smollm2-135m \
        --calib wiki-summaries --batch-size 4 --seq-len 256 --steps 200 \
        --ppl runs/quality_q4/smollm2-135m-0.5/wiki-summaries-heldout.txt --eval-seq-len 1024

The windows are `quantize`'s (`training_windows`: the whole calibration source cut to --seq-len), from the
same default source (the run's own calibration text)."""

import argparse
import json
import time
from pathlib import Path

import torch

from leapctl.compute import native_bf16
from leapctl.data import training_windows
from leapctl.eval.perplexity import perplexity
from leapctl.models import load_model
from leapctl.quantize.config import DEFAULT_CALIB
from leapctl.quantize.tune import tune_scales
from leapctl.runs import read_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a quantized run folder (leapctl quantize --tune-steps 0)")
    parser.add_argument("--teacher", required=True, help="the dense model")
    parser.add_argument("--calib", default=None,
                        help="tuning text (default: as quantize, the text the run was calibrated on)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ppl", action="append", required=True, help="text file(s) to score")
    parser.add_argument("--eval-seq-len", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 autocast (default: as quantize, where the CPU has bf16 arithmetic)")
    parser.add_argument("--skip-before", action="store_true", help="do not score the run before tuning")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = read_run(args.run)
    if run.scales is None:
        raise SystemExit(f"{args.run} is not quantized")
    model, tokenizer = load_model(str(run.path), dtype=torch.float32)
    teacher, _ = load_model(args.teacher, dtype=torch.float32)
    texts = {Path(p).name: Path(p).read_text() for p in args.ppl}

    def scores() -> dict[str, float]:
        return {name: round(perplexity(model, tokenizer, text, args.eval_seq_len, progress=False), 3)
                for name, text in texts.items()}

    before = None if args.skip_before else scores()
    calib = args.calib or run.calibration_source or DEFAULT_CALIB
    windows = training_windows(calib, tokenizer, teacher, args.steps, args.batch_size, args.seq_len)
    started = time.perf_counter()
    autocast = args.autocast if args.autocast is not None else native_bf16(torch.device("cpu"))
    result = tune_scales(model, teacher, run.scales, windows, args.steps, args.lr, args.batch_size,
                         autocast=autocast)
    seconds = round(time.perf_counter() - started, 1)
    print(json.dumps({"run": args.run, "calib": calib, "steps": args.steps, "batch_size": args.batch_size,
                      "seq_len": args.seq_len, "autocast": autocast, "windows": int(windows.shape[0]),
                      "ppl_before": before, "ppl_after": scores(), "kl_first": result.kl[0],
                      "kl_last": result.kl[-1], "tune_seconds": seconds,
                      "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
