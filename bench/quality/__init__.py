"""Perplexity studies, one module each, run as `python -m bench.quality STUDY [options]`:

- `prune`: magnitude, Wanda, SparseGPT and LEAP side by side at each sparsity (results/quality/quality_*.md);
- `q4`: sparse + 4-bit: LEAP or Wanda, then GPTQ or RTN, scale tuning, lm_head (quality_q4_*.md);
- `grid`: which 4-bit grid a pruned SmolLM2 loses least on (quality_grid_*.md);
- `head`: lm_head in 8 or 4 bits, x rounded as served (quality_head_*.md);
- `int8`: the cost of rounding x to int8 in the served 4-bit layers (quality_int8_*.md);
- `layers`: which layers carry a quantized run's 4-bit cost (quality_layers_*.md);
- `tune`: end-to-end scale tuning of a quantized run folder;
- `objective`: LEAP's loss (LM, distillation, mixes) at one budget (objective_*.md)."""

STUDIES = {"prune": "prune", "q4": "q4", "grid": "grid", "head": "head", "int8": "int8", "layers": "layers",
           "tune": "tune", "objective": "objective"}
