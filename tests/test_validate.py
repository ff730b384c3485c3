"""`leapctl validate`: an intact export passes every check; each kind of damage (truncated shard, flipped
byte, dropped tensor, edited row offset, other masks, a wrong serving op) fails and names its file or
tensor."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import pruned_run, random_masks, run_cli  # noqa: F401  (pruned_run is a fixture)

from leapctl.export import export
from leapctl.validate import validate

LAYER = "model.layers.1.self_attn.k_proj"


@pytest.fixture(scope="module")
def bitmap_export(pruned_run, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("export") / "bitmap"
    export(str(pruned_run), "bitmap", out, max_shard_size="150KB")
    return out


@pytest.fixture
def damaged(bitmap_export, tmp_path) -> Path:
    """A private copy of the export to break."""
    return Path(shutil.copytree(bitmap_export, tmp_path / "copy"))


def shard_of(export_dir: Path, tensor: str) -> Path:
    index = json.loads((export_dir / "model.safetensors.index.json").read_text())
    return export_dir / index["weight_map"][tensor]


def rewrite(export_dir: Path, tensor: str, edit) -> None:
    shard = shard_of(export_dir, tensor)
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def failed(report) -> list[tuple[str, str, str]]:
    return [(c.kind, c.target, c.detail) for c in report.failures]


def test_intact_export_passes_every_check(bitmap_export):
    report = validate(bitmap_export)
    assert failed(report) == []
    passed = {c.kind for c in report.checks if c.ok}
    kinds = {"files", "reference", "format", "decode", "dense", "sparse-linear", "logits", "generate"}
    assert kinds <= passed
    layers = json.loads((bitmap_export / "manifest.json").read_text())["layers"]
    assert sum(c.kind == "sparse-linear" and c.ok for c in report.checks) == len(layers)


def test_truncated_shard(damaged):
    shard = shard_of(damaged, f"{LAYER}.values")
    shard.write_bytes(shard.read_bytes()[:-100])
    problems = failed(validate(damaged, end_to_end=False))
    assert ("files", shard.name) in {(kind, target) for kind, target, _ in problems}
    assert any(kind == "tensors" and target == shard.name and "cannot read" in detail
               for kind, target, detail in problems)
    assert any(kind == "format" and target == LAYER and "missing" in detail
               for kind, target, detail in problems)


def test_flipped_byte_in_values(damaged):
    shard = shard_of(damaged, f"{LAYER}.values")
    data = bytearray(shard.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    begin, end = json.loads(data[8:8 + header_len])[f"{LAYER}.values"]["data_offsets"]
    data[8 + header_len + (begin + end) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    problems = failed(validate(damaged, end_to_end=False))
    assert any(kind == "files" and target == shard.name and "sha256" in detail
               for kind, target, detail in problems)
    assert any(kind == "decode" and target == LAYER and "differ" in detail
               for kind, target, detail in problems)


def test_dropped_tensor(damaged):
    rewrite(damaged, f"{LAYER}.row_offsets", lambda t: t.pop(f"{LAYER}.row_offsets"))
    problems = failed(validate(damaged, end_to_end=False))
    assert any(kind == "format" and target == LAYER and f"{LAYER}.row_offsets missing" in detail
               for kind, target, detail in problems)
    assert any(kind == "tensors" and target == f"{LAYER}.row_offsets" for kind, target, _ in problems)


def test_edited_row_offset_fails_the_cli(damaged, capsys):
    def edit(tensors):
        tensors[f"{LAYER}.row_offsets"][3] += 1
    rewrite(damaged, f"{LAYER}.row_offsets", edit)
    problems = failed(validate(damaged, end_to_end=False))
    assert any(kind == "format" and target == LAYER and "row_offsets[3]" in detail
               for kind, target, detail in problems)
    assert run_cli("validate", damaged, "--no-end-to-end") == 1
    out = capsys.readouterr().out
    assert LAYER in out and "FAIL" in out


def test_other_masks_are_caught(bitmap_export, pruned_run, stories260k_dir, tmp_path):  # noqa: F811
    from leapctl.masks import save_masks
    from leapctl.models import load_model

    model, _ = load_model(str(stories260k_dir))
    other = tmp_path / "other.safetensors"
    save_masks(other, random_masks(model, seed=1))
    problems = failed(validate(bitmap_export, reference=str(pruned_run), end_to_end=False))
    assert problems == []
    # the same model with other masks as the reference: every pruned layer must differ
    other_run = Path(shutil.copytree(pruned_run, tmp_path / "run"))
    shutil.copy(other, other_run / "masks.safetensors")
    problems = failed(validate(bitmap_export, reference=str(other_run), end_to_end=False))
    layers = json.loads((bitmap_export / "manifest.json").read_text())["layers"]
    assert {target for kind, target, _ in problems if kind == "decode"} == set(layers)


def test_a_wrong_serving_op_is_caught(bitmap_export, monkeypatch):
    import serving.sparse_linear

    real = serving.sparse_linear.bitmap_linear

    def off_by_a_little(x, bitmap, values, row_offsets, n_cols, bias=None):
        return real(x, bitmap, values * 1.01, row_offsets, n_cols, bias)

    monkeypatch.setattr(serving.sparse_linear, "bitmap_linear", off_by_a_little)
    problems = failed(validate(bitmap_export, end_to_end=False))
    layers = json.loads((bitmap_export / "manifest.json").read_text())["layers"]
    assert {target for kind, target, _ in problems if kind == "sparse-linear"} == set(layers)


def test_a_wrong_native_kernel_path_is_caught_and_named(bitmap_export, monkeypatch):
    """validate runs the native op on every instruction set the CPU runs; one wrong path fails each layer."""
    from serving import cpu_kernel

    if not cpu_kernel.load() or "avx2" not in cpu_kernel.supported_isas():
        pytest.skip("needs the native kernel with its AVX2 path")
    real = torch.ops.leap_sparse_cpu.bitmap_linear

    def wrong_on_avx2(x, bitmap, values, row_offsets, n_cols, bias=None):
        scale = 1.01 if cpu_kernel.current_isa() == "avx2" else 1.0
        return real(x, bitmap, values * scale, row_offsets, n_cols, bias)

    monkeypatch.setattr(torch.ops.leap_sparse_cpu, "bitmap_linear", wrong_on_avx2)
    problems = failed(validate(bitmap_export, end_to_end=False))
    layers = json.loads((bitmap_export / "manifest.json").read_text())["layers"]
    assert {target for kind, target, _ in problems if kind == "sparse-linear"} == set(layers)
    details = [detail for kind, _, detail in problems if kind == "sparse-linear"]
    assert all(detail.startswith("avx2: max |difference|") for detail in details)


def test_not_an_export(tmp_path, capsys):
    assert run_cli("validate", tmp_path) == 2
    assert "manifest.json" in capsys.readouterr().err


def test_a_bad_kernel_choice_is_one_error_line(bitmap_export, monkeypatch, capsys):
    from serving import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "_status", None)  # load again, reading the environment
    monkeypatch.setenv("LEAP_SPARSE_CPU_ISA", "fast")
    assert run_cli("validate", bitmap_export, "--no-end-to-end") == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "LEAP_SPARSE_CPU_ISA='fast': use auto, avx512 or avx2" in err
    monkeypatch.setenv("LEAP_SPARSE_CPU_ISA", "auto")
    monkeypatch.setattr(cpu_kernel, "_status", None)
    assert cpu_kernel.load()
