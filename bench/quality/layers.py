"""Where a quantized run's 4-bit cost sits: the 4-bit model scored as it is, then with one kind of layer
(q_proj ... down_proj, lm_head) or one third of the decoder blocks given back its weights from the 16-bit
run it was quantized from, everything else (the other weights, the tuned normalisation weights) as it is.
The share of the cost a row wins back is (ppl 4-bit - ppl row) / (ppl 4-bit - ppl 16-bit): it says which
layers a finer grid, more calibration or training of the codes would pay off on.

    python -m bench.quality layers Q4_RUN RUN16 [--heldout 60] [--wikitext-chars 60000] [--seq-len 512]
        [--out bench/results/quality/quality_layers_smollm2-135m]

Texts as `bench.quality head` (held-apart summaries, WikiText-2's test split). One thread. Writes OUT.json
and OUT.md."""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from bench.harness import RESULTS as BENCH_RESULTS
from bench.quality.head import eval_texts
from leapctl.eval import perplexity
from leapctl.models import load_model, model_layout
from leapctl.quantize import LM_HEAD

RESULTS = BENCH_RESULTS / "quality"
THIRDS = 3


def linear_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> weight of every linear inside the decoder blocks (`model_layout`'s), in model order."""
    return {f"{name}.weight": linear.weight for name, linear in model_layout(model).linears.items()}


def variant_names(model: nn.Module) -> dict[str, list[str]]:
    """Row label -> the weight names given back their 16-bit values in that row."""
    layout = model_layout(model)
    linears = list(linear_weights(model))
    kinds = dict.fromkeys(name.split(".")[-2] for name in linears)  # in the model's order
    blocks = len(layout.blocks)
    rows = {f"{kind} 16-bit": [n for n in linears if n.split(".")[-2] == kind] for kind in kinds}
    rows["lm_head 16-bit"] = [LM_HEAD]
    for third in range(THIRDS):
        first, last = third * blocks // THIRDS, (third + 1) * blocks // THIRDS - 1
        rows[f"blocks {first}-{last} 16-bit"] = [n for n in linears if first <= layout.block_index(n) <= last]
    rows["every block linear 16-bit"] = linears
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quantized", help="a quantized run folder (leapctl quantize)")
    parser.add_argument("source", help="the 16-bit run folder it was quantized from")
    parser.add_argument("--heldout", type=int, default=60)
    parser.add_argument("--wikitext-chars", type=int, default=60000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS / "quality_layers_smollm2-135m")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model, tokenizer = load_model(args.quantized, dtype=torch.float32)
    source, _ = load_model(args.source, dtype=torch.float32)
    texts = eval_texts(args.heldout, args.wikitext_chars)
    theirs = linear_weights(source) | {LM_HEAD: source.get_output_embeddings().weight}
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        raise SystemExit("error: the quantized run's lm_head is tied to its input embedding: nothing to "
                         "give back alone")
    ours = linear_weights(model) | {LM_HEAD: model.get_output_embeddings().weight}

    def score(label: str, scored: nn.Module) -> dict:
        started = time.perf_counter()
        row = {"row": label, "ppl": {t: perplexity(scored, tokenizer, text, seq_len=args.seq_len)
                                     for t, text in texts.items()}}
        row["seconds"] = round(time.perf_counter() - started, 1)
        print(label, {t: round(v, 3) for t, v in row["ppl"].items()}, flush=True)
        return row

    rows = [score("16-bit run", source), score("4-bit run (as it is)", model)]
    del source
    for label, names in variant_names(model).items():
        kept = {name: ours[name].detach().clone() for name in names}
        with torch.no_grad():
            for name in names:
                ours[name].copy_(theirs[name])
        rows.append(score(label, model))
        with torch.no_grad():
            for name in names:
                ours[name].copy_(kept[name])

    full, four = rows[0]["ppl"], rows[1]["ppl"]
    lines = [f"# Where the 4-bit cost sits: {args.quantized}", "",
             f"`python -m bench.quality layers {args.quantized} {args.source} --heldout {args.heldout} "
             f"--wikitext-chars {args.wikitext_chars} --seq-len {args.seq_len}` "
             f"({time.strftime('%Y-%m-%d')}, one thread, load average {os.getloadavg()[0]:.2f} at the end). "
             "Share: the part of the 4-bit run's cost over the 16-bit run that the row wins back.", "",
             "| weights | " + " | ".join(f"{t} | share" for t in texts) + " |",
             "| --- |" + " --- | --- |" * len(texts)]
    for row in rows:
        cells = []
        for t in texts:
            cost = four[t] - full[t]
            cells += [f"{row['ppl'][t]:.3f}", f"{(four[t] - row['ppl'][t]) / cost:.0%}" if cost else "-"]
        lines.append(f"| {row['row']} | " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"quantized": args.quantized, "source": args.source,
                                                         "seq_len": args.seq_len, "rows": rows}, indent=2)
                                             + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
