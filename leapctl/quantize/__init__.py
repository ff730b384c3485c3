"""4-bit quantization of a pruned model's kept weights, on a `bitmap-q4` grid (sparse_formats.bitmap_q4):
each kept weight becomes `scale * (code - 7.5)` (symmetric) or `scale * (code - zero)` (asymmetric, an
integer zero point per group) with an fp16 scale per row and group of input columns.

One call does the whole job: `quantize_model(model, tokenizer, mask_set, QuantizeConfig(...))`
(`job.py`): the kept weights by one of the registry's methods (`methods.QUANTIZERS`: `rtn`, round to
nearest with the scale searched per group, `leapctl.grid`; `gptq`, GPTQ restricted to the kept weights with
the mask fixed, calibrated block by block on the quantized blocks' outputs, `gptq.py`), lm_head on its grid,
then the scales tuned end to end (`tune.py`). The model is quantized in place: its weights become the
dequantized values (exact in fp32), so a quantized run folder is an ordinary checkpoint that eval,
transformers and stock vLLM read, and `export --format bitmap-q4` turns it into codes and scales bit for
bit. `leapctl.commands.quantize` (`leapctl quantize`) loads a run, calls it and writes the new run."""

from leapctl.grid import ASYMMETRIC, GRIDS, SYMMETRIC
from leapctl.quantize.config import QuantizeConfig
from leapctl.quantize.job import Quantized, lm_head_bits, quantization_entry, quantize_model, tuning_teacher
from leapctl.quantize.methods import LM_HEAD, QUANTIZERS, quantize_lm_head, quantize_weights

__all__ = ["ASYMMETRIC", "GRIDS", "LM_HEAD", "QUANTIZERS", "QuantizeConfig", "Quantized", "SYMMETRIC",
           "lm_head_bits", "quantization_entry", "quantize_lm_head", "quantize_model", "quantize_weights",
           "tuning_teacher"]
