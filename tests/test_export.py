"""`leapctl export` on the real stories260K with masks made here: serving layout and config, HF sharding,
manifest checksums, compressed-tensors' layout read back by a plain decompressor, tiled-csl, ONNX."""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from leapctl.masks import MaskSet
from leapctl.models import load_model, prunable_linears
from leapctl.runs import MASKS_FILE, save_run

UNPRUNED = "model.layers.4.mlp.down_proj"


def random_masks(model, density: float = 0.5, seed: int = 0) -> MaskSet:
    """Random keep-masks on every decoder linear but one (left dense to exercise `ignore`)."""
    gen = torch.Generator().manual_seed(seed)
    masks = {f"{name}.weight": torch.rand(layer.weight.shape, generator=gen) < density
             for name, layer in prunable_linears(model).items() if name != UNPRUNED}
    return MaskSet(masks=masks, model="stories260K", extra={"method": "random", "seed": seed})


@pytest.fixture(scope="session")
def pruned_run(tmp_path_factory, stories260k_dir) -> Path:
    """A run folder as prune writes it: masked checkpoint, masks.safetensors, report.json."""
    out = tmp_path_factory.mktemp("run")
    model, tokenizer = load_model(str(stories260k_dir))
    mask_set = random_masks(model)
    save_run(out, model, tokenizer, mask_set, {"method": "random"})
    return out


def run_cli(*args: str, capsys=None) -> int:
    """Run `leapctl ARGS` in this process; returns the exit status."""
    from leapctl.cli import main

    old = sys.argv
    sys.argv = ["leapctl", *map(str, args)]
    try:
        main()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = old
    return 0


def masked_reference(run: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, masks) of the run, read independently of leapctl.commands.export."""
    weights = load_file(str(run / "model.safetensors"))
    masks = {}
    with safe_open(str(run / MASKS_FILE), framework="pt") as handle:
        shapes = json.loads(handle.metadata()["shapes"])
        for name in handle.keys():
            packed = handle.get_tensor(name).numpy()
            masks[name] = torch.from_numpy(np.unpackbits(packed, axis=1, count=shapes[name][1],
                                                         bitorder="little").astype(bool))
    return weights, masks


def plain_bitmap_decode(shape, bitmap, values) -> torch.Tensor:
    """compressed-tensors' bitmask_decompress, written out: unpack little-endian bits, scatter in order."""
    rows, cols = shape.tolist()
    keep = np.unpackbits(bitmap.numpy(), axis=1, count=cols, bitorder="little").astype(bool)
    dense = torch.zeros((rows, cols), dtype=values.dtype)
    dense[torch.from_numpy(keep)] = values
    return dense


def read_export(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(str(out / name)))
    return tensors


def test_bitmap_export_is_the_serving_checkpoint(pruned_run, tmp_path):
    out = tmp_path / "bitmap"
    assert run_cli("export", pruned_run, "--format", "bitmap", "--out", out, "--max-shard-size", "150KB") == 0
    weights, masks = masked_reference(pruned_run)

    config = json.loads((out / "config.json").read_text())
    kept = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    assert config["quantization_config"] == {"quant_method": "leap_sparse", "format": "bitmap",
                                             "sparsity": pytest.approx(1 - kept / total),
                                             "ignore": ["lm_head", UNPRUNED]}
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True

    # HF sharding: numbered shards, an index whose weight map names the shard that holds each tensor
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                          for i in range(1, len(shards) + 1)]
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as handle:
            assert sorted(handle.keys()) == sorted(k for k, v in index["weight_map"].items() if v == shard)
    tensors = read_export(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())

    for name, mask in masks.items():
        layer = name.removesuffix(".weight")
        assert name not in tensors
        assert tensors[f"{layer}.shape"].dtype == torch.int64
        assert tensors[f"{layer}.row_offsets"].dtype == torch.int64
        decoded = plain_bitmap_decode(tensors[f"{layer}.shape"], tensors[f"{layer}.bitmap"],
                                      tensors[f"{layer}.values"])
        assert torch.equal(decoded, torch.where(mask, weights[name], 0.0))
        counts = mask.sum(dim=1)
        assert tensors[f"{layer}.row_offsets"].tolist() == (counts.cumsum(0) - counts).tolist()
    # everything else stays dense and equal; tied lm_head is not written, as HF writes it
    dense = {k for k in weights if k not in masks}
    assert dense == {k for k in tensors if k.endswith(".weight")}
    assert all(torch.equal(tensors[k], weights[k]) for k in dense)
    assert "lm_head.weight" not in tensors and f"{UNPRUNED}.weight" in tensors

    # side files copied, run files not; manifest checksums match the files
    side_files = {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert side_files <= {p.name for p in out.iterdir()}
    assert not (out / "leapctl").exists() and not (out / "report.json").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {p.name for p in out.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == listed
    for name, info in manifest["files"].items():
        data = (out / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    layer = manifest["layers"]["model.layers.0.self_attn.q_proj"]
    mask = masks["model.layers.0.self_attn.q_proj.weight"]
    assert layer["density"] == pytest.approx(float(mask.float().mean()))
    assert layer["dense_bytes"] == mask.numel() * 4
    assert layer["sparse_bytes"] == 16 + mask.shape[0] * 8 + int(mask.sum()) * 4 + mask.shape[0] * 8
    assert manifest["masks"]["origin"] == {"method": "random", "seed": 0}
    assert manifest["source"]["path"] == str(pruned_run.resolve())


def test_compressed_tensors_layout_and_config(pruned_run, tmp_path):
    from compressed_tensors.config import BitmaskConfig

    out = tmp_path / "ct"
    assert run_cli("export", pruned_run, "--format", "compressed-tensors", "--out", out) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    sparsity = BitmaskConfig.model_validate(config["sparsity_config"])
    assert sparsity.format == "sparse-bitmask" and sparsity.ignore == ["lm_head", UNPRUNED]
    weights, masks = masked_reference(pruned_run)
    tensors = read_export(out)
    for name, mask in masks.items():
        layer = name.removesuffix(".weight")
        assert {k for k in tensors if k.startswith(layer + ".")} == {
            f"{layer}.{k}" for k in ("shape", "compressed", "bitmask", "row_offsets")}
        decoded = plain_bitmap_decode(tensors[f"{layer}.shape"], tensors[f"{layer}.bitmask"],
                                      tensors[f"{layer}.compressed"])
        assert torch.equal(decoded, torch.where(mask, weights[name], 0.0))


def test_model_plus_masks_equals_run_export(pruned_run, stories260k_dir, tmp_path):
    masks = tmp_path / "masks.safetensors"
    masks.write_bytes((pruned_run / MASKS_FILE).read_bytes())
    assert run_cli("export", stories260k_dir, "--masks", masks, "--format", "csr",
                   "--out", tmp_path / "a") == 0
    assert run_cli("export", pruned_run, "--format", "csr", "--out", tmp_path / "b") == 0
    a, b = read_export(tmp_path / "a"), read_export(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tiled_csl_casts_an_fp32_run_to_the_16_bits_it_needs(pruned_run, tmp_path, capsys):
    """The fp32 run exports as float16 by default, saying so in one line; --dtype picks bfloat16 and
    refuses float32 (the format cannot hold it) with one line and nothing written."""
    assert run_cli("export", pruned_run, "--format", "tiled-csl", "--out", tmp_path / "t") == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "casting" in line]
    assert len(said) == 1 and "float16" in said[0] and "float32" in said[0]
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "tiled-csl" and config["dtype"] == "float16"
    tensors = read_export(tmp_path / "t")
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16
    assert tensors["model.layers.0.mlp.up_proj.words"].dtype == torch.int32
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["dtype"] == "float16" and "casting" in manifest["dtype_cast_reason"]

    assert run_cli("export", pruned_run, "--format", "tiled-csl", "--dtype", "bfloat16", "--out",
                   tmp_path / "b") == 0
    assert "casting" not in capsys.readouterr().err
    assert read_export(tmp_path / "b")["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert run_cli("export", pruned_run, "--format", "tiled-csl", "--dtype", "float32", "--out",
                   tmp_path / "f") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "float16 or bfloat16" in err
    assert not (tmp_path / "f").exists()


def test_bad_input_is_one_line_and_writes_nothing(pruned_run, stories260k_dir, tmp_path, capsys):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("x")
    assert run_cli("export", pruned_run, "--format", "bitmap", "--out", occupied) == 2
    assert "not empty" in capsys.readouterr().err and (occupied / "keep.txt").exists()
    # --overwrite replaces only a folder leapctl wrote (issue 20)
    assert run_cli("export", pruned_run, "--format", "bitmap", "--out", occupied, "--overwrite") == 2
    assert "not written by leapctl" in capsys.readouterr().err and (occupied / "keep.txt").exists()
    (occupied / "keep.txt").unlink()
    assert run_cli("export", pruned_run, "--format", "csr", "--out", occupied) == 0
    assert run_cli("export", pruned_run, "--format", "bitmap", "--out", occupied, "--overwrite") == 0
    assert json.loads((occupied / "manifest.json").read_text())["format"] == "bitmap"

    assert run_cli("export", stories260k_dir, "--format", "bitmap", "--out", tmp_path / "x") == 2
    assert "--masks" in capsys.readouterr().err
    assert run_cli("export", pruned_run, "--format", "zip", "--out", tmp_path / "x") == 2
    assert "unknown export format" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_onnx_export_runs_in_onnxruntime(pruned_run, tmp_path):
    from leapctl.commands.validate import validate

    out = tmp_path / "onnx"
    assert run_cli("export", pruned_run, "--format", "onnx", "--out", out) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["onnx_check"]["max_abs_logit_diff"] <= manifest["onnx_check"]["tolerance"]
    report = validate(out)
    assert not report.failures and any(c.kind == "logits" and c.ok for c in report.checks)
    assert sum(c.kind == "decode" and c.ok for c in report.checks) == len(manifest["layers"])


def test_qwen2_untied_with_biases_round_trips(tiny_checkpoint, tmp_path):
    """Qwen2: q/k/v biases stay dense beside the sparse weights, the untied lm_head is written dense."""
    from leapctl.commands.validate import validate

    model, tokenizer = load_model(str(tiny_checkpoint("qwen2")))
    run = tmp_path / "run"
    run.mkdir()
    save_run(run, model, tokenizer, random_masks(model, density=0.4), {"method": "random"})
    out = tmp_path / "bitmap"
    assert run_cli("export", run, "--format", "bitmap", "--out", out) == 0
    tensors = read_export(out)
    assert "model.layers.0.self_attn.q_proj.bias" in tensors and "lm_head.weight" in tensors
    assert "model.layers.0.self_attn.q_proj.bitmap" in tensors
    report = validate(out)
    assert [c for c in report.failures] == []
    assert any(c.kind == "generate" and c.ok for c in report.checks)
