"""What lm_head's grid costs in perplexity: a model scored with lm_head as it is, on the 8-bit grid
(`quantize --lm-head-bits 8`, `sparse_formats.int8_rows`: int8 codes, one fp16 scale per row), with x also
rounded as the served 8-bit lm_head rounds it (`serving.int8_linear.int8_rows_activations`, per token), and
on the 4-bit grids (`--lm-head-bits 4`, symmetric and `--grid asymmetric`, groups of 64 and 32, before any
tuning): round to nearest, and GPTQ on what lm_head receives from `--calib-samples` windows of 256 tokens of
wiki-summaries (`quantize_lm_head` with calibration, as `quantize --method gptq` runs it). Only lm_head
changes (untied from the input embedding), so the rows isolate it.

    python -m bench.quality head [MODEL] [--heldout 60] [--wikitext-chars 60000] [--seq-len 1024]
        [--calib-samples 128] [--out bench/results/quality/quality_head_smollm2-135m]

Texts: the first `--heldout` held-apart Wikipedia summaries (never calibrated on) and the first
`--wikitext-chars` characters of WikiText-2's test split (shared assets). One thread. Writes OUT.json and
OUT.md."""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from bench.harness import RESULTS as BENCH_RESULTS
from leapctl.data import WIKI_SUMMARIES, WIKI_SUMMARIES_HELDOUT, calibration_batch, load_documents
from leapctl.eval import perplexity
from leapctl.grid import GRIDS, rtn_quantize
from leapctl.models import load_model, untie_output_embeddings
from leapctl.paths import assets_dir
from leapctl.quantize import quantize_lm_head
from serving.int8_linear import int8_rows_activations
from sparse_formats import int8_rows

RESULTS = BENCH_RESULTS / "quality"


def head_variants(model: nn.Module, dense: torch.Tensor,
                  calib_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, bool]]:
    """Variant name -> (lm_head weight, whether its input is rounded to int8 per row); `model`'s lm_head is
    left holding `dense`."""
    scales = int8_rows.row_scales(dense)
    int8 = int8_rows.dequantize(int8_rows.quantize_codes(dense, scales), scales)
    everything = torch.ones(dense.shape, dtype=torch.bool)
    variants = {"16-bit (as it is)": (dense, False), "8-bit": (int8, False),
                "8-bit, x rounded per row": (int8, True)}
    for grid in GRIDS:
        for group in (64, 32):
            four, _, _ = rtn_quantize(dense, everything, group, grid)
            variants[f"4-bit {grid}, group {group} (rtn)"] = (four, False)
            head = model.get_output_embeddings()
            head.weight.data.copy_(dense)
            quantize_lm_head(model, 4, group, grid, calib_ids, batch_size=8)
            variants[f"4-bit {grid}, group {group} (gptq)"] = (head.weight.detach().clone(), False)
            head.weight.data.copy_(dense)
    return variants


def eval_texts(heldout: int, wikitext_chars: int) -> dict[str, str]:
    """Label -> text: the first `heldout` held-apart Wikipedia summaries and, where the shared assets hold it,
    the first `wikitext_chars` characters of WikiText-2's test split."""
    texts = {f"wiki-summaries-heldout (first {heldout})":
             "\n\n".join(load_documents(WIKI_SUMMARIES_HELDOUT)[:heldout])}
    wikitext = (assets_dir() or Path("/nonexistent")) / "wikitext-2-raw" / "wiki.test.raw"
    if wikitext.is_file():
        texts[f"WikiText-2 test (first {wikitext_chars} chars)"] = wikitext.read_text()[:wikitext_chars]
    return texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--heldout", type=int, default=60)
    parser.add_argument("--wikitext-chars", type=int, default=60000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--calib-samples", type=int, default=128, help="GPTQ's windows of 256 tokens")
    parser.add_argument("--out", type=Path, default=RESULTS / "quality_head_smollm2-135m")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, tokenizer = load_model(args.model, dtype=torch.float32)
    texts = eval_texts(args.heldout, args.wikitext_chars)
    untie_output_embeddings(model)
    head = model.get_output_embeddings()
    dense = head.weight.detach().clone()
    calib_ids = calibration_batch(WIKI_SUMMARIES, tokenizer, args.calib_samples, 256, 0)
    rows = []
    for name, (weight, round_x) in head_variants(model, dense, calib_ids).items():
        head.weight = nn.Parameter(weight, requires_grad=False)  # lm_head alone: untied from the embedding
        hook = head.register_forward_pre_hook(lambda _m, a: (int8_rows_activations(a[0]).to(a[0].dtype),)) \
            if round_x else None
        started = time.perf_counter()
        row = {"lm_head": name, "ppl": {t: perplexity(model, tokenizer, text, seq_len=args.seq_len)
                                         for t, text in texts.items()}}
        row["seconds"] = round(time.perf_counter() - started, 1)
        if hook is not None:
            hook.remove()
        rows.append(row)
        print(name, {t: round(v, 3) for t, v in row["ppl"].items()}, flush=True)

    base = rows[0]["ppl"]
    lines = [f"# lm_head's grid: perplexity cost on {args.model}", "",
             f"`python -m bench.quality head {args.model} --heldout {args.heldout} --wikitext-chars "
             f"{args.wikitext_chars} --seq-len {args.seq_len} --calib-samples {args.calib_samples}` "
             f"({time.strftime('%Y-%m-%d')}, one thread, "
             f"load average {os.getloadavg()[0]:.2f} at the end); only lm_head changes.", "",
             "| lm_head | " + " | ".join(texts) + " |", "| --- |" + " --- |" * len(texts)]
    for row in rows:
        cells = [f"{row['ppl'][t]:.3f} ({row['ppl'][t] / base[t] - 1:+.2%})" for t in texts]
        lines.append(f"| {row['lm_head']} | " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"model": args.model, "seq_len": args.seq_len,
                                                         "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
