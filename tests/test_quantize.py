"""4-bit quantization of kept weights (`leapctl quantize`), its export (`bitmap-q4`) and validation.

References: the bitmap-q4 grid itself (every kept weight must encode back exactly), plain absmax rounding
(the scale search may only lower the error), GPTQ with a diagonal Hessian (no error to spread: it must
equal round to nearest), and the layer's output error on correlated inputs (what GPTQ minimises)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from leapctl.grid import group_error, rtn_quantize, search_scales
from leapctl.quantize.gptq import gptq_quantize
from sparse_formats import get_format
from sparse_formats.bitmap_q4 import absmax_scales

Q4 = get_format("bitmap-q4")


def weight_and_mask(rows: int, cols: int, seed: int, density: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen)
    mask = torch.rand(rows, cols, generator=gen) < density
    return weight, mask


def test_rtn_puts_kept_weights_on_the_grid_and_zeros_the_rest():
    weight, mask = weight_and_mask(24, 128, seed=0)
    quantized, scales, _ = rtn_quantize(weight, mask, 64)
    assert bool((quantized[~mask] == 0).all())
    Q4.encode(quantized, mask, scales=scales)  # raises if any kept weight is off its scale's grid


def test_the_scale_search_never_loses_to_plain_absmax():
    weight, mask = weight_and_mask(64, 256, seed=1)
    w, keep = weight.view(64, -1, 64), mask.view(64, -1, 64)
    searched = group_error(w, keep, search_scales(weight, mask, 64))
    plain = group_error(w, keep, absmax_scales(weight, mask, 64))
    assert bool((searched <= plain).all()) and float(searched.sum()) < float(plain.sum())


@pytest.mark.parametrize("act_order", [True, False], ids=["act-order", "natural-order"])
@pytest.mark.parametrize("grid", ["symmetric", "asymmetric"])
def test_gptq_with_a_diagonal_hessian_is_round_to_nearest(act_order, grid):
    """Without correlations no error moves between columns, in either order: GPTQ is rtn."""
    weight, mask = weight_and_mask(16, 256, seed=2)
    hessian = torch.diag(torch.rand(256, generator=torch.Generator().manual_seed(3)) + 0.5)
    got, got_scales, got_zeros = gptq_quantize(weight, mask, hessian, 64, grid=grid, act_order=act_order)
    expected, expected_scales, expected_zeros = rtn_quantize(weight, mask, 64, grid)
    assert torch.equal(got_scales, expected_scales)
    assert got_zeros is expected_zeros is None or torch.equal(got_zeros, expected_zeros)
    assert torch.equal(got, expected)


def correlated_inputs(cols: int, seed: int) -> torch.Tensor:
    """Calibration inputs of rank ~32 plus noise, with input channels of very different energy (as a
    model's are: what act order sorts by)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 32, generator=gen) @ torch.randn(32, cols, generator=gen) \
        + 0.1 * torch.randn(2048, cols, generator=gen)
    return x * (0.2 + 3 * torch.rand(cols, generator=gen))


@pytest.mark.parametrize("act_order", [True, False], ids=["act-order", "natural-order"])
def test_gptq_lowers_the_output_error_on_correlated_inputs(act_order):
    weight, mask = weight_and_mask(64, 256, seed=4)
    x = correlated_inputs(256, seed=5)
    hessian = 2 * x.T @ x / x.shape[0]
    target = x @ (weight * mask).T
    gptq, scales, _ = gptq_quantize(weight * mask, mask, hessian, 64, act_order=act_order)
    rtn, _, _ = rtn_quantize(weight, mask, 64)
    Q4.encode(gptq, mask, scales=scales)
    assert bool((gptq[~mask] == 0).all())
    assert float((x @ gptq.T - target).norm()) < 0.7 * float((x @ rtn.T - target).norm())


@pytest.mark.parametrize("grid", ["symmetric", "asymmetric"])
def test_act_order_fixes_every_group_grid_up_front_and_lowers_the_error(grid):
    """Act order (the default) searches each group's grid on its weights as they are, before any error
    moves (so the grids are rtn's), and on inputs of uneven energy ends with a smaller output error than
    the natural order. A dead input (never active) counts as 0 in the grid search, as GPTQ treats it."""
    weight, mask = weight_and_mask(64, 256, seed=6)
    x = correlated_inputs(256, seed=7)
    x[:, 3] = 0
    hessian = 2 * x.T @ x / x.shape[0]
    target = x @ (weight * mask).T
    errors = {}
    for act_order in (True, False):
        got, scales, zeros = gptq_quantize(weight, mask, hessian, 64, grid=grid, act_order=act_order)
        errors[act_order] = float((x @ got.T - target).norm())
        if act_order:
            dead_zeroed = weight.clone()
            dead_zeroed[:, 3] = 0
            _, rtn_scales, rtn_zeros = rtn_quantize(dead_zeroed, mask, 64, grid)
            assert torch.equal(scales, rtn_scales)
            assert zeros is rtn_zeros is None or torch.equal(zeros, rtn_zeros)
    assert errors[True] < errors[False]


def test_gptq_lm_head_sees_what_the_model_feeds_it_and_beats_rounding_on_it(stories260k_dir):
    """`feed_lm_head_inputs` gives exactly the inputs a whole forward hands lm_head (block by block, through
    the final norm), and GPTQ of lm_head on them (every weight kept, untied from the input embedding first)
    leaves a smaller output error on those inputs than rounding to nearest on the same grid."""
    from leapctl.grid import ASYMMETRIC
    from leapctl.models import load_model, untie_output_embeddings
    from leapctl.prune.sequential import feed_lm_head_inputs
    from leapctl.quantize import quantize_lm_head

    model, _ = load_model(str(stories260k_dir), dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0))
    seen = []
    hook = model.lm_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(ids[:4])
        model(ids[4:])
    hook.remove()
    fed = []
    feed_lm_head_inputs(model, ids, fed.append, batch_size=4)
    assert len(fed) == 2 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fed, seen, strict=True))

    table = model.get_input_embeddings().weight.detach().clone()
    assert untie_output_embeddings(model) and not model.config.tie_word_embeddings
    dense = model.lm_head.weight.detach().clone()
    x = torch.cat([f.reshape(-1, f.shape[-1]) for f in fed])
    errors = {}
    for calib in (None, ids):
        model.lm_head.weight.data.copy_(dense)
        scales, zeros = quantize_lm_head(model, 4, 64, ASYMMETRIC, calib, batch_size=4)
        Q4.encode(model.lm_head.weight.detach(), torch.ones(dense.shape, dtype=torch.bool), scales=scales,
                  zeros=zeros)  # raises if off the grid
        errors[calib is None] = float((x @ (model.lm_head.weight.detach() - dense).T).square().sum())
    assert errors[False] < errors[True]
    assert torch.equal(model.get_input_embeddings().weight, table)  # the embedding kept its values


def test_gptq_of_lm_head_in_the_blocks_pass_equals_gptq_after_it(stories260k_dir):
    """GPTQ of lm_head fed from the end of the blocks' own GPTQ pass (`gptq_scales(lm_head=True)`) gives bit
    for bit the weights, scales and zero points of GPTQ on a second block-by-block pass over the quantized
    model (`quantize_lm_head` with the calibration): the same blocks' outputs, computed once, not twice."""
    from test_serve_cli import magnitude_masks

    from leapctl.grid import ASYMMETRIC
    from leapctl.masks import MaskSet, apply_masks
    from leapctl.models import load_model, untie_output_embeddings
    from leapctl.quantize import LM_HEAD, quantize_lm_head, quantize_weights

    results = {}
    for one_pass in (True, False):
        model, _ = load_model(str(stories260k_dir), dtype=torch.float32)
        ids = torch.randint(0, model.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(1))
        mask_set = MaskSet({name: mask for name, mask in magnitude_masks(model, 0.5).items()
                            if mask.shape[1] % 64 == 0})  # down_proj's 172 columns take no group of 64
        apply_masks(model, mask_set)
        untie_output_embeddings(model)
        scales, zeros = quantize_weights(model, mask_set, "gptq", 64, ids, ASYMMETRIC, batch_size=4,
                                         progress=False, lm_head=one_pass)
        if not one_pass:
            assert LM_HEAD not in scales
            scales[LM_HEAD], zeros[LM_HEAD] = quantize_lm_head(model, 4, 64, ASYMMETRIC, ids, batch_size=4)
        results[one_pass] = (model.lm_head.weight.detach().clone(), scales[LM_HEAD], zeros[LM_HEAD])
    for ours, theirs in zip(results[True], results[False], strict=True):
        assert torch.equal(ours, theirs)
    assert not torch.equal(results[True][0], load_model(str(stories260k_dir))[0].lm_head.weight)


@pytest.mark.parametrize("autocast", [False, True])
def test_scale_tuning_moves_only_scales_and_norms_and_lowers_the_kl(stories260k_dir, autocast):
    """Property: tuning may change a group's scale, never a code or a mask, and it lowers the KL to the dense
    model it minimises (measured in fp32 on the calibration windows before and after); lm_head's scales are
    tuned too and its tie to the input embedding survives. The same with the matmuls in bf16 (autocast):
    the scales learn in fp32 and the weights are rebuilt from them in fp32."""
    from test_serve_cli import magnitude_masks

    from leapctl.distill import language_model_and_distillation
    from leapctl.masks import MaskSet, apply_masks
    from leapctl.models import load_model
    from leapctl.quantize import LM_HEAD, quantize_lm_head, quantize_weights
    from leapctl.quantize.tune import normalisation_weights, tune_scales
    from sparse_formats.bitmap_q4 import GRID_OFFSET

    torch.manual_seed(0)
    teacher, _ = load_model(str(stories260k_dir), dtype=torch.float32)
    model, _ = load_model(str(stories260k_dir), dtype=torch.float32)
    masks = {name: mask for name, mask in magnitude_masks(model, 0.5).items() if "down_proj" not in name}
    mask_set = MaskSet(masks=masks, model=str(stories260k_dir))
    apply_masks(model, mask_set)
    scales, _ = quantize_weights(model, mask_set, "rtn", 64)
    scales[LM_HEAD], _ = quantize_lm_head(model, 4, 64)  # tied to the input embedding: the tie must hold
    masks[LM_HEAD] = torch.ones(model.lm_head.weight.shape, dtype=torch.bool)

    def codes(name: str, layer_scales: torch.Tensor) -> torch.Tensor:
        weight = model.get_submodule(name.removesuffix(".weight")).weight
        spread = layer_scales.float().repeat_interleave(64, dim=1)
        return torch.where(masks[name], weight / spread + GRID_OFFSET, torch.full((), -1.0))

    before = {name: codes(name, s) for name, s in scales.items()}
    norms_before = [w.detach().clone() for w in normalisation_weights(model)]
    ids = torch.randint(0, teacher.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1))

    def kl() -> float:
        with torch.no_grad():
            return float(language_model_and_distillation(model(ids).logits, teacher(ids).logits, ids)[1])

    start = kl()
    result = tune_scales(model, teacher, scales, ids, steps=40, lr=3e-3, batch_size=8, progress=False,
                         autocast=autocast)
    assert kl() < 0.9 * start
    assert result.norms == len(norms_before) > 0
    assert any(not torch.equal(a, b) for a, b in zip(norms_before, normalisation_weights(model), strict=True))
    changed = 0
    for name, layer_scales in result.scales.items():
        assert layer_scales.dtype == torch.float16
        assert torch.equal(codes(name, layer_scales), before[name])  # same codes, exactly, on the new scales
        changed += int((layer_scales != scales[name]).sum())
        Q4.encode(model.get_submodule(name.removesuffix(".weight")).weight.detach(), masks[name],
                  scales=layer_scales)
    assert changed > 0 and not torch.equal(result.scales[LM_HEAD], scales[LM_HEAD])
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_scale_tuning_with_checkpointing_recomputes_blocks_and_learns_the_same_scales(stories260k_dir):
    """Property: recomputing each decoder block in the backward (gradient checkpointing) is an exact
    rewrite of the same computation: the same KL at every step and the same scales, bit for bit; the blocks
    did run twice a step (forward and recompute), and are left in eval mode with checkpointing off."""
    from test_serve_cli import magnitude_masks

    from leapctl.masks import MaskSet, apply_masks
    from leapctl.models import load_model
    from leapctl.quantize import quantize_weights
    from leapctl.quantize.tune import tune_scales

    teacher, _ = load_model(str(stories260k_dir), dtype=torch.float32)
    ids = torch.randint(0, teacher.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1))
    results, block_calls = {}, {}
    for checkpointing in (False, True):
        model, _ = load_model(str(stories260k_dir), dtype=torch.float32)
        masks = {name: mask for name, mask in magnitude_masks(model, 0.5).items() if "down_proj" not in name}
        mask_set = MaskSet(masks=masks, model=str(stories260k_dir))  # down_proj: 172 columns, no group of 64
        apply_masks(model, mask_set)
        scales, _ = quantize_weights(model, mask_set, "rtn", 64)
        block = model.model.layers[0]
        calls = []
        # a pre-hook: a recompute stops once it has the tensors the backward needs, before the block's end
        hook = block.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        results[checkpointing] = tune_scales(model, teacher, scales, ids, steps=3, lr=3e-3, batch_size=4,
                                             progress=False, checkpointing=checkpointing)
        hook.remove()
        block_calls[checkpointing] = len(calls)
        assert not model.is_gradient_checkpointing and not any(m.training for m in model.modules())
    assert block_calls == {False: 3, True: 6}
    assert results[True].kl == results[False].kl
    for name, layer_scales in results[False].scales.items():
        assert torch.equal(results[True].scales[name], layer_scales)


# ---------------------------------------------------------------- the command, on stories260K


@pytest.mark.parametrize(("report", "source"), [
    ({"command": "prune", "calibration": {"source": "generated", "nsamples": 8}}, "generated"),
    ({"command": "prune", "calibration": None}, None),  # magnitude: no calibration
    ({"settings": {"calib": "texts.jsonl", "steps": 200}}, "texts.jsonl"),  # learn
    ({}, None),  # a mask file without a report
])
def test_a_run_names_the_text_its_masks_were_calibrated_on(report, source):
    from leapctl.runs import Run

    run = Run(spec="run", path=Path("run"), masks_file=Path("run"), masks=None, report=report)
    assert run.calibration_source == source


def leapctl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapctl", *args], capture_output=True, text=True, cwd=cwd)


TUNE_STEPS = 20


@pytest.fixture(scope="module")
def wanda_run(stories260k_dir, tmp_path_factory):
    """stories260K at 50% (Wanda), every linear but down_proj, whose 172 columns no group divides."""
    out = tmp_path_factory.mktemp("q") / "wanda"
    done = leapctl("prune", str(stories260k_dir), "--method", "wanda", "--sparsity", "0.5", "--calib",
                   "generated", "--nsamples", "8", "--seq-len", "64", "--exclude", "down_proj",
                   "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def quantized_run(wanda_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "gptq"
    # No --calib: quantize calibrates on the text the masks were (here: generated samples). 20 tuning steps,
    # not the default 200: the same code path, 90 s less on a Zen 3 core.
    done = leapctl("quantize", str(wanda_run), "--nsamples", "8", "--seq-len", "64", "--tune-steps",
                   str(TUNE_STEPS), "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def q4_export(quantized_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "export"
    done = leapctl("export", str(quantized_run), "--format", "bitmap-q4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def test_a_quantized_run_keeps_the_masks_and_sits_on_its_grid(wanda_run, quantized_run):
    from leapctl.runs import read_run

    source, run = read_run(str(wanda_run)), read_run(str(quantized_run))
    assert run.masks.masks.keys() == source.masks.masks.keys()
    assert all(torch.equal(run.masks.masks[k], source.masks.masks[k]) for k in run.masks.masks)
    assert run.quantization["bits"] == 4 and run.quantization["group_size"] == 64
    weights = load_file(str(quantized_run / "model.safetensors"))
    assert run.quantization["grid"] == "asymmetric"  # the default
    for name, mask in run.masks.masks.items():
        Q4.encode(weights[name], mask, scales=run.scales[name], zeros=run.zeros[name])
        assert bool((weights[name][~mask] == 0).all())
    # lm_head on the 8-bit grid by default: stories260K ties it to the input embedding, which holds its values
    assert run.quantization["lm_head_bits"] == 8
    get_format("int8-rows").encode(weights["model.embed_tokens.weight"], scales=run.scales["lm_head.weight"])


def test_the_tuning_is_reported_and_plotted(quantized_run):
    from leapctl.compute import native_bf16
    from leapctl.quantize.config import QuantizeConfig

    assert QuantizeConfig.tune_steps > 0  # tuning is on by default
    report = json.loads((quantized_run / "report.json").read_text())
    tuning = report["tuning"]
    assert report["calibration"]["source"] == tuning["source"] == "generated"  # the wanda run's text
    assert tuning["autocast"] == native_bf16(torch.device("cpu"))  # bf16 where this CPU multiplies it
    assert len(tuning["kl"]) == tuning["steps"] == TUNE_STEPS
    assert tuning["kl_last_10"] < tuning["kl_first"]
    assert (quantized_run / "tune_kl.png").stat().st_size > 0


def test_quantize_model_is_the_commands_whole_job_in_one_call(wanda_run, quantized_run):
    """Property: `quantize_model` in memory, on the run and settings the command had, gives the very scales,
    zero points and tuning curve the command wrote (GPTQ, lm_head, tuning: nothing left in the command)."""
    from leapctl.models import load_model
    from leapctl.quantize import QuantizeConfig, quantize_model
    from leapctl.runs import read_run

    source, written = read_run(str(wanda_run)), read_run(str(quantized_run))
    model, tokenizer = load_model(str(wanda_run), dtype=torch.float32)
    config = QuantizeConfig(run=str(wanda_run), out=Path("unused"), nsamples=8, seq_len=64,
                            tune_steps=TUNE_STEPS, calib=source.calibration_source, progress=False)
    done = quantize_model(model, tokenizer, source.masks, config)
    assert done.quantization == written.quantization
    assert done.tuning["kl"] == json.loads((quantized_run / "report.json").read_text())["tuning"]["kl"]
    for ours, theirs in ((done.scales, written.scales), (done.zeros, written.zeros)):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in theirs)

def test_the_export_validates_against_the_quantized_run(q4_export):
    done = leapctl("validate", str(q4_export))
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = json.loads((q4_export / "manifest.json").read_text())
    assert manifest["format"] == "bitmap-q4"
    config = json.loads((q4_export / "config.json").read_text())
    assert config["quantization_config"]["format"] == "bitmap-q4"
    assert config["quantization_config"]["lm_head_format"] == manifest["layers"]["lm_head"]["format"] \
        == "int8-rows"



def test_validate_multiplies_the_8_bit_lm_head_on_every_path(q4_export):
    from leapctl.commands.validate import validate
    from serving.int8_linear import native_int8_available, onednn_int8_available

    report = validate(str(q4_export), end_to_end=False)
    head = [c for c in report.checks if c.kind == "sparse-linear" and c.target == "lm_head"]
    assert len(head) == 1 and head[0].ok, report.checks
    assert ("oneDNN" in head[0].detail) == onednn_int8_available() and "decode" in head[0].detail
    assert ("native" in head[0].detail) == native_int8_available(int(json.loads(
        (q4_export / "manifest.json").read_text())["layers"]["lm_head"]["shape"][1]))


def damaged_export(q4_export, tmp_path, edit) -> str:
    """A copy of the export with one layer's tensor edited (checksums no longer match either)."""
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(q4_export, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    layer = "model.layers.1.self_attn.q_proj"
    edit(tensors, layer)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return str(copy)


def flip_code(tensors, layer):
    tensors[f"{layer}.codes"][5] ^= 0x01


def flip_scale(tensors, layer):
    tensors[f"{layer}.scales"].view(torch.int16)[2, 0] ^= 0x0400


def extra_kept_weight(tensors, layer):
    """One more set bit in a word that kept an even count: the codes no longer cover the bitmap."""
    words = tensors[f"{layer}.bitmap"].view(torch.int32).view(-1)
    for index in range(words.numel()):
        word = int(words[index]) & 0xFFFFFFFF
        if bin(word).count("1") % 2 == 0 and word != 0xFFFFFFFF:
            bit = next(b for b in range(32) if not word >> b & 1)
            tensors[f"{layer}.bitmap"].view(-1)[4 * index + bit // 8] |= 1 << (bit % 8)
            return
    raise AssertionError("no word with an even count")


def flip_head_code(tensors, _layer):
    tensors["lm_head.qweight"][3, 5] ^= 0x01


def flip_head_scale(tensors, _layer):
    tensors["lm_head.scales"].view(torch.int16)[2] ^= 0x0400


def negative_head_scale(tensors, _layer):
    tensors["lm_head.scales"][6] = -tensors["lm_head.scales"][6]


@pytest.mark.parametrize(("edit", "target", "kind", "message"), [
    (flip_code, "model.layers.1.self_attn.q_proj", "decode", "weights differ from the reference"),
    (flip_scale, "model.layers.1.self_attn.q_proj", "decode", "weights differ from the reference"),
    (extra_kept_weight, "model.layers.1.self_attn.q_proj", "format", "bitmap/code count mismatch"),
    (flip_head_code, "lm_head", "decode", "weights differ from the reference"),
    (flip_head_scale, "lm_head", "decode", "weights differ from the reference"),
    (negative_head_scale, "lm_head", "format", "scales[6] is -"),
], ids=["code", "scale", "popcount", "lm_head-code", "lm_head-scale", "lm_head-negative-scale"])
def test_validate_names_a_damaged_layer(q4_export, tmp_path, edit, target, kind, message):
    from leapctl.commands.validate import validate

    report = validate(damaged_export(q4_export, tmp_path, edit), end_to_end=False)
    failed = [c for c in report.failures if c.target == target]
    assert any(c.kind == kind and message in c.detail for c in failed), report.failures


@pytest.fixture(scope="module")
def asymmetric_export(wanda_run, tmp_path_factory):
    """`--grid asymmetric` with lm_head on the same 4-bit grid (every weight kept: the dense layout)."""
    root = tmp_path_factory.mktemp("asym")
    done = leapctl("quantize", str(wanda_run), "--grid", "asymmetric", "--lm-head-bits", "4", "--nsamples",
                   "8", "--seq-len", "64", "--tune-steps", "20", "--out", str(root / "run"), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "asymmetric grid" in done.stdout
    done = leapctl("export", str(root / "run"), "--format", "bitmap-q4", "--out", str(root / "export"))
    assert done.returncode == 0, done.stderr
    return root


def test_the_asymmetric_grid_holds_every_kept_weight_and_its_zero_points(asymmetric_export, wanda_run):
    from leapctl.runs import read_run

    run = read_run(str(asymmetric_export / "run"))
    assert run.quantization["grid"] == "asymmetric" and run.zeros.keys() == run.scales.keys()
    weights = load_file(str(asymmetric_export / "run" / "model.safetensors"))
    # lm_head was tied to the input embedding: a 4-bit head is untied, and the embedding keeps its values
    assert not json.loads((asymmetric_export / "run" / "config.json").read_text())["tie_word_embeddings"]
    start = load_file(str(wanda_run / "model.safetensors"))
    assert torch.equal(weights["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    everything = torch.ones(weights["lm_head.weight"].shape, dtype=torch.bool)
    masks = {**run.masks.masks, "lm_head.weight": everything}
    used = set()
    for name, mask in masks.items():
        zeros = run.zeros[name]
        assert zeros.dtype == torch.uint8 and zeros.shape == run.scales[name].shape and int(zeros.max()) < 16
        Q4.encode(weights[name], mask, scales=run.scales[name], zeros=zeros)  # raises if off the grid
        used |= set(zeros.unique().tolist())
    assert len(used) > 2  # the zero points follow the groups, not one fixed offset


def test_an_asymmetric_export_validates_and_names_its_grid(asymmetric_export):
    from leapctl.commands.validate import validate

    export = asymmetric_export / "export"
    config = json.loads((export / "config.json").read_text())["quantization_config"]
    assert config["grid"] == "asymmetric" and "lm_head_format" not in config
    manifest = json.loads((export / "manifest.json").read_text())
    assert all(f"{layer}.zeros" in info["tensors"] for layer, info in manifest["layers"].items())
    report = validate(str(export), end_to_end=True)
    assert not report.failures, report.failures
    assert any(c.kind == "logits" and c.ok for c in report.checks)
    head = [c for c in report.checks if c.kind == "sparse-linear" and c.target == "lm_head"]
    assert len(head) == 1 and head[0].ok and "avx2" in head[0].detail, head


def flip_zero(tensors, layer):
    tensors[f"{layer}.zeros"][3, 0] ^= 0x01


def padding_zero(tensors, _layer):
    """A nibble after the last group of a layer with an odd group count (stories260K's 64 columns: one)."""
    tensors["model.layers.0.self_attn.k_proj.zeros"][0, 0] |= 0x10


@pytest.mark.parametrize(("edit", "target", "kind", "message"), [
    (flip_zero, "model.layers.1.self_attn.q_proj", "decode", "weights differ from the reference"),
    (padding_zero, "model.layers.0.self_attn.k_proj", "format", "nonzero padding nibble"),
], ids=["zero", "zero-padding"])
def test_validate_names_a_damaged_zero_point(asymmetric_export, tmp_path, edit, target, kind, message):
    from leapctl.commands.validate import validate

    report = validate(damaged_export(asymmetric_export / "export", tmp_path, edit), end_to_end=False)
    failed = [c for c in report.failures if c.target == target]
    assert any(c.kind == kind and message in c.detail for c in failed), report.failures


@pytest.mark.parametrize(("args", "message"), [
    (["--grid", "nf4"], "unknown --grid 'nf4'"),
    (["--bits", "3"], "--bits 3 is not supported"),
    (["--lm-head-bits", "6"], "--lm-head-bits 6 is not supported"),
    (["--group-size", "48"], "multiple of 32"),
    (["--method", "awq"], "unknown --method"),
    (["--tune-steps", "-1"], "--tune-steps must be >= 0"),
    (["--teacher", "/no/such/model"], "is neither a local folder"),
])
def test_bad_options_exit_2_with_one_line_and_write_nothing(wanda_run, tmp_path, args, message):
    out = tmp_path / "never"
    done = leapctl("quantize", str(wanda_run), "--out", str(out), *args)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not out.exists()


def test_a_group_size_that_does_not_divide_a_layer_is_named(stories260k_dir, tmp_path):
    run = tmp_path / "all"
    assert leapctl("prune", str(stories260k_dir), "--method", "magnitude", "--sparsity", "0.5",
                   "--out", str(run)).returncode == 0
    done = leapctl("quantize", str(run), "--method", "rtn", "--out", str(tmp_path / "never"))
    assert done.returncode == 2 and "does not divide the 172 input columns" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "never").exists()


def test_a_model_without_masks_is_refused(stories260k_dir, tmp_path):
    done = leapctl("quantize", str(stories260k_dir), "--method", "rtn", "--out", str(tmp_path / "never"))
    assert done.returncode == 2 and "not a run folder" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "never").exists()


def test_export_of_an_unquantized_run_is_refused(wanda_run, tmp_path):
    done = leapctl("export", str(wanda_run), "--format", "bitmap-q4", "--out", str(tmp_path / "never"))
    assert done.returncode == 2 and "is not quantized" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "never").exists()


def test_quantize_never_replaces_its_own_run(wanda_run, tmp_path):
    before = sorted(p.name for p in wanda_run.iterdir())
    done = leapctl("quantize", str(wanda_run), "--method", "rtn", "--out", str(wanda_run), "--overwrite")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert sorted(p.name for p in wanda_run.iterdir()) == before


def test_runs_written_before_lm_head_bits_read_as_what_they_hold():
    """`lm_head: true` (the old --lm-head) was the 4-bit grid; no entry means lm_head was left as it is."""
    from leapctl.quantize import lm_head_bits

    assert lm_head_bits({"lm_head": True}) == 4
    assert lm_head_bits({"lm_head": False}) == lm_head_bits({}) == 16
    assert lm_head_bits({"lm_head_bits": 8, "lm_head": True}) == 8
