"""`leapctl quantize`: the kept weights of a run folder on a 4-bit grid, into a new run folder."""

import typer

from leapctl.cli import app
from leapctl.quantize.config import QuantizeConfig
from leapctl.settings import config_command


def _quantize(config: QuantizeConfig) -> None:
    from leapctl.quantize import quantize_run

    report = quantize_run(config)
    q = report["quantization"]
    layers = len(report["achieved_sparsity"]["per_layer"])
    typer.echo(f"{q['method']}: {layers} pruned layers quantized to {q['bits']} bits (group "
               f"{q['group_size']}) in {report['quantize_seconds']:.1f}s -> {config.out}")


config_command(app, QuantizeConfig, _quantize, name="quantize",
               help="Quantize the kept weights of a pruned RUN to 4 bits (codes and a scale per group) and "
                    "write a run folder of the dequantized model, ready for export --format bitmap-q4.")
