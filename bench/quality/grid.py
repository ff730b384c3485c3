"""Which 4-bit grid a pruned SmolLM2 loses least on: the `bitmap-q4` grid (`scale * (code - 7.5)`, symmetric,
no zero level) against two asymmetric ones, before building either into the format and the kernels.

- `symmetric`: the shipped grid (`leapctl.grid`: scale searched per group over 16 clips).
- `asym-zero`: `scale * (code - zero)` with an integer zero in 0..15 per group (GPTQ's asymmetric grid; the
  search `quantize --grid asymmetric` runs, `leapctl.grid.search_asymmetric`).
  A pruned weight is exactly the zero point, so a kernel can expand the kept codes into a register of
  the zero (merge-masked `vpexpandb`) and subtract `zero * sum(x over the group)`, which no row changes:
  one more multiply-add per row and group.
- `asym-min`: `scale * code + min` with an fp16 min per group (llama.cpp's Q4_1, whose grid SmolLM2's
  weights came from). A kernel would need each row's sum of x over its kept columns: a reference ceiling.

Each grid is tried with round to nearest and with GPTQ restricted to the kept weights (the mask fixed,
block by block, as `quantize --method gptq`), at group sizes 32, 64 and 128, on a Wanda 50% model made here
(wiki-summaries). No tuning: the rows compare grids, not `quantize`'s full recipe.

    python -m bench.quality grid [--sparsity 0.5] [--nsamples 64] [--seq-len 512] [--grids ...]
        [--groups 32 64 128] [--methods rtn gptq] [--out bench/results/quality/quality_grid_smollm2-135m]

Texts: the first 60 held-apart Wikipedia summaries and the first 60k characters of WikiText-2's test split,
1024-token windows. Writes OUT.json and OUT.md (rows are added as they finish)."""

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import RESULTS as BENCH_RESULTS
from bench.quality.head import eval_texts
from leapctl.data import WIKI_SUMMARIES, calibration_batch
from leapctl.eval import perplexity
from leapctl.grid import (
    CLIP_STEPS,
    SMALLEST_CLIP,
    round_to_grid,
    search_asymmetric,
    search_scales,
)
from leapctl.masks import MaskSet
from leapctl.models import load_model
from leapctl.prune import prune_model
from leapctl.prune.obs import feed_errors_forward, inverse_hessian_factor
from leapctl.prune.sequential import update_under_masks
from leapctl.prune.sparsegpt import SparseGPTPruner

RESULTS = BENCH_RESULTS / "quality"
LEVELS = 16


@dataclass(frozen=True)
class Grid:
    """A 4-bit grid: `fit(w, keep)` -> per-row parameters of one group [rows, G]; `values(w, params)` -> w
    [rows, n] moved to its nearest level (params broadcast over the n columns)."""

    name: str
    fit: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
    values: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]


def symmetric_fit(w: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (search_scales(w, keep, w.shape[1])[:, 0],)


def symmetric_values(w: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return round_to_grid(w, params[0].unsqueeze(1))


def _best(w: torch.Tensor, keep: torch.Tensor, candidates, values) -> tuple[torch.Tensor, ...]:
    """The candidate parameters with the least squared error on each row's kept weights."""
    best, best_error = None, None
    for params in candidates:
        error = torch.where(keep, (w - values(w, params)) ** 2, torch.zeros(())).sum(dim=1)
        if best is None:
            best, best_error = list(params), error
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = [torch.where(better, new, old) for new, old in zip(params, best, strict=True)]
    return tuple(best)


def zero_fit(w: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`quantize --grid asymmetric`'s own search, for one group."""
    scales, zeros = search_asymmetric(w, keep, w.shape[1])
    return scales[:, 0], zeros[:, 0]


def zero_values(w: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return round_to_grid(w, params[0].unsqueeze(1), params[1].unsqueeze(1))


def min_values(w: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    scale, low = (p.float().unsqueeze(1) for p in params)
    safe = torch.where(scale > 0, scale, torch.ones(()))
    return torch.round((w - low) / safe).clamp(0, LEVELS - 1) * scale + low


def min_fit(w: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
    big = torch.finfo(torch.float32).max
    lo = torch.where(keep, w, torch.full((), big)).amin(dim=1)
    hi = torch.where(keep, w, torch.full((), -big)).amax(dim=1)
    lo = torch.where(keep.any(dim=1), lo, torch.zeros(()))
    hi = torch.where(keep.any(dim=1), hi, lo)
    mid = (lo + hi) / 2

    def candidate(shrink: float):
        half = (hi - lo) * shrink / 2
        low = (mid - half).to(torch.float16)
        return ((2 * half / (LEVELS - 1)).to(torch.float16), low)

    return _best(w, keep, [candidate(s) for s in torch.linspace(1.0, SMALLEST_CLIP, CLIP_STEPS).tolist()],
                 min_values)


GRIDS = {grid.name: grid for grid in (Grid("symmetric", symmetric_fit, symmetric_values),
                                      Grid("asym-zero", zero_fit, zero_values),
                                      Grid("asym-min", min_fit, min_values))}


def rtn(weight: torch.Tensor, mask: torch.Tensor, grid: Grid, group_size: int) -> torch.Tensor:
    out = torch.zeros_like(weight, dtype=torch.float32)
    for start in range(0, weight.shape[1], group_size):
        w, keep = weight[:, start:start + group_size].float(), mask[:, start:start + group_size]
        out[:, start:start + group_size] = torch.where(keep, grid.values(w, grid.fit(w, keep)), 0.0)
    return out


def gptq(weight: torch.Tensor, mask: torch.Tensor, hessian: torch.Tensor, grid: Grid, group_size: int,
         block: int = 128) -> torch.Tensor:
    """`leapctl.quantize.gptq.gptq_quantize` in its natural order (`act_order=False`, what these results
    were measured with) with the grid as a parameter, on the same column loop (`prune.obs`)."""
    W = weight.detach().float().clone()
    U, dead = inverse_hessian_factor(hessian)
    W[:, dead] = 0
    params = None

    def target(columns: torch.Tensor, start: int, i: int) -> torch.Tensor:
        nonlocal params
        column = start + i
        if column % group_size == 0:
            params = grid.fit(columns[:, i:i + group_size], mask[:, column:column + group_size])
        w = columns[:, i]
        return torch.where(mask[:, column], grid.values(w.unsqueeze(1), params)[:, 0], torch.zeros(()))

    feed_errors_forward(W, U, group_size * -(-block // group_size), target)
    return W


class GridGPTQ(SparseGPTPruner):
    def __init__(self, linear, mask, grid: Grid, group_size: int):
        super().__init__(linear)
        self.mask, self.grid, self.group_size = mask, grid, group_size

    @torch.no_grad()
    def prune(self, sparsity: float) -> torch.Tensor:
        self.linear.weight.copy_(gptq(self.linear.weight, self.mask, self.take_hessian(), self.grid,
                                      self.group_size))
        return self.mask.cpu()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--grids", nargs="+", default=list(GRIDS), choices=list(GRIDS))
    parser.add_argument("--groups", nargs="+", type=int, default=[64, 32, 128])
    parser.add_argument("--methods", nargs="+", default=["rtn", "gptq"], choices=["rtn", "gptq"])
    parser.add_argument("--heldout", type=int, default=60)
    parser.add_argument("--wikitext-chars", type=int, default=60000)
    parser.add_argument("--eval-seq-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "quality_grid_smollm2-135m")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=torch.float32)
    texts = eval_texts(args.heldout, args.wikitext_chars)
    calib = calibration_batch(WIKI_SUMMARIES, tokenizer, args.nsamples, args.seq_len, seed=0)
    mask_set: MaskSet = prune_model(model, "wanda", args.sparsity, calib)
    pruned = {name: model.get_submodule(name.removesuffix(".weight")).weight.detach().clone()
              for name in mask_set.masks}
    rows = []

    def score(label: str, started: float) -> None:
        row = {"variant": label, "ppl": {t: perplexity(model, tokenizer, text, seq_len=args.eval_seq_len,
                                                       progress=False) for t, text in texts.items()},
               "seconds": round(time.perf_counter() - started, 1)}
        rows.append(row)
        print(label, {t: round(v, 3) for t, v in row["ppl"].items()}, flush=True)
        write(args, texts, rows)

    score(f"Wanda {args.sparsity:.0%}, 16-bit values", time.perf_counter())
    for method in args.methods:
        for group in args.groups:
            for name in args.grids:
                grid, started = GRIDS[name], time.perf_counter()
                for weight_name, weight in pruned.items():
                    model.get_submodule(weight_name.removesuffix(".weight")).weight.data.copy_(weight)
                if method == "rtn":
                    with torch.no_grad():
                        for weight_name, mask in mask_set.masks.items():
                            linear = model.get_submodule(weight_name.removesuffix(".weight"))
                            linear.weight.copy_(rtn(linear.weight, mask, grid, group))
                else:
                    update_under_masks(model, calib, mask_set,
                                       lambda linear, mask, _n, g=grid, G=group: GridGPTQ(linear, mask, g, G),
                                       f"gptq {name} G{group}", progress=False)
                score(f"{method}, {name}, G = {group}", started)


def write(args, texts: dict, rows: list[dict]) -> None:
    base = rows[0]["ppl"]
    lines = [f"# 4-bit grids on {args.model}, Wanda {args.sparsity:.0%}", "",
             f"`python -m bench.quality grid --sparsity {args.sparsity} --nsamples {args.nsamples} --seq-len "
             f"{args.seq_len} --threads {args.threads}` ({time.strftime('%Y-%m-%d %H:%M')}, load average "
             f"{os.getloadavg()[0]:.2f}); calibration wiki-summaries, {args.eval_seq_len}-token windows, "
             "no tuning. Change against the 16-bit Wanda model in brackets.", "",
             "| variant | " + " | ".join(texts) + " | seconds |", "| --- |" + " --- |" * (len(texts) + 1)]
    for row in rows:
        cells = [f"{row['ppl'][t]:.3f} ({row['ppl'][t] / base[t] - 1:+.1%})" for t in texts]
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + f" | {row['seconds']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"model": args.model, "sparsity": args.sparsity,
                                                         "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
