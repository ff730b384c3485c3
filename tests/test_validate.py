"""`leapctl validate`: an intact export of every format passes every check; each kind of damage (truncated
shard, flipped byte, dropped tensor, edited row offset, unlisted file, misplaced index entry, unexpected
tensor, changed dense tensor, a bitmap that differs from the reference mask, differing logits, other masks,
a wrong serving op, no reference at all) fails and names its file or tensor; a manifest naming files outside
the folder is refused, and validate asks no server unless --reference says so."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import pruned_run, random_masks, run_cli  # noqa: F401  (pruned_run is a fixture)

from leapctl.commands.export import export
from leapctl.commands.validate import validate

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
    from leapctl.runs import MASKS_FILE

    model, _ = load_model(str(stories260k_dir))
    other = tmp_path / "other.safetensors"
    save_masks(other, random_masks(model, seed=1))
    problems = failed(validate(bitmap_export, reference=str(pruned_run), end_to_end=False))
    assert problems == []
    # the same model with other masks as the reference: every pruned layer must differ
    other_run = Path(shutil.copytree(pruned_run, tmp_path / "run"))
    shutil.copy(other, other_run / MASKS_FILE)
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


def restamp(export_dir: Path, *files: Path) -> None:
    """Record edited files' new sizes and checksums in the manifest, as a faulty writer would have: the
    files check then passes and the damage must be caught by what the content says."""
    from leapctl.exporters.base import sha256_file

    manifest_path = export_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for path in files:
        manifest["files"][path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    manifest_path.write_text(json.dumps(manifest))


def test_an_unlisted_file_is_named(damaged):
    (damaged / "notes.txt").write_text("not from the exporter")
    assert ("files", "notes.txt", "not listed in the manifest") in failed(validate(damaged, end_to_end=False))


def test_an_index_that_points_at_the_wrong_shard_is_named(damaged):
    index_path = damaged / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    tensor = f"{LAYER}.values"
    elsewhere = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][tensor])
    index["weight_map"][tensor] = elsewhere
    index_path.write_text(json.dumps(index))
    restamp(damaged, index_path)
    problems = failed(validate(damaged, end_to_end=False))
    assert ("tensors", tensor, f"the index puts it in {elsewhere}, which does not hold it") in problems


def test_an_unexpected_tensor_is_named(damaged):
    import torch

    shard = shard_of(damaged, f"{LAYER}.values")
    rewrite(damaged, f"{LAYER}.values", lambda t: t.update({"model.stowaway": torch.zeros(3)}))
    restamp(damaged, shard)
    assert ("tensors", "model.stowaway", f"unexpected tensor in {shard.name}") in failed(
        validate(damaged, end_to_end=False))


def test_a_changed_dense_tensor_is_named(damaged):
    shard = shard_of(damaged, "model.norm.weight")
    rewrite(damaged, "model.norm.weight", lambda t: t["model.norm.weight"].mul_(1.5))
    restamp(damaged, shard)
    problems = failed(validate(damaged, end_to_end=False))
    assert [(kind, target) for kind, target, _ in problems] == [("dense", "model.norm.weight")]
    assert "weights differ from the reference" in problems[0][2]


def test_a_bitmap_that_drops_a_kept_zero_is_named(stories260k_dir, tmp_path):
    """Values alone cannot show it: the reference keeps a weight whose value is 0.0, the damaged bitmap
    marks it pruned and drops that value, and the layer still decodes to the same numbers."""
    import torch

    from leapctl.models import load_model
    from leapctl.runs import save_run

    model, tokenizer = load_model(str(stories260k_dir))
    masks = random_masks(model)
    name = f"{LAYER}.weight"
    col = int(masks.masks[name][0].nonzero()[0])
    with torch.no_grad():
        dict(model.named_parameters())[name][0, col] = 0.0
    run = tmp_path / "run"
    run.mkdir()
    save_run(run, model, tokenizer, masks, {"method": "random"})
    out = tmp_path / "bitmap"
    export(str(run), "bitmap", out)
    assert failed(validate(out, end_to_end=False)) == []

    def drop_first_kept_of_row_0(tensors):
        tensors[f"{LAYER}.bitmap"][0, col // 8] &= ~(1 << (col % 8))
        tensors[f"{LAYER}.values"] = tensors[f"{LAYER}.values"][1:].clone()
        tensors[f"{LAYER}.row_offsets"][1:] -= 1

    rewrite_single(out, drop_first_kept_of_row_0)
    problems = failed(validate(out, end_to_end=False))
    assert problems == [("decode", LAYER, "bitmap differs from the reference mask at 1 positions")]


def rewrite_single(export_dir: Path, edit) -> None:
    shard = export_dir / "model.safetensors"
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    restamp(export_dir, shard)


def test_differing_logits_are_named(damaged):
    """A config edited after export (every tensor intact) changes what the model computes."""
    config_path = damaged / "config.json"
    config = json.loads(config_path.read_text())
    config["rms_norm_eps"] = 0.5
    config_path.write_text(json.dumps(config))
    restamp(damaged, config_path)
    problems = failed(validate(damaged))
    assert {kind for kind, _, _ in problems} <= {"logits", "generate"}
    assert any(kind == "logits" and "max |difference|" in detail for kind, _, detail in problems)


def test_no_reachable_reference_says_nothing_was_compared(bitmap_export, tmp_path, capsys):
    """The export moved to a machine without its source: validate must not report success."""
    moved = Path(shutil.copytree(bitmap_export, tmp_path / "moved"))
    manifest_path = moved / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["source"]["path"] = str(tmp_path / "gone")
    manifest["masks"]["file"] = str(tmp_path / "gone" / "masks.safetensors")
    manifest_path.write_text(json.dumps(manifest))
    report = validate(moved)
    assert [c.kind for c in report.failures] == ["reference"]
    assert "nothing was compared" in report.failures[0].detail
    assert not any(c.kind in ("decode", "logits") and c.ok for c in report.checks)
    assert run_cli("validate", moved) == 1
    out = capsys.readouterr().out
    assert "nothing was compared" in out and "all checks passed" not in out


@pytest.mark.parametrize("fmt", ["bitmap", "csr", "tiled-csl", "tiled-bitmap", "compressed-tensors"])
def test_every_checkpoint_format_exports_and_validates_bit_for_bit(pruned_run, tmp_path, fmt):  # noqa: F811
    from leapctl.exporters import exporter_names

    assert fmt in exporter_names()
    out = tmp_path / fmt
    manifest = export(str(pruned_run), fmt, out)
    report = validate(out)
    assert failed(report) == []
    decoded = [c for c in report.checks if c.kind == "decode" and c.ok]
    assert len(decoded) == len(manifest["layers"]) and all("bit-exact" in c.detail for c in decoded)
    assert any(c.kind == "logits" and c.ok for c in report.checks)


def test_csr_export_decodes_with_scipy(pruned_run, tmp_path):  # noqa: F811
    """An independent decoder: scipy's CSR matrix from the stored arrays equals the masked weight."""
    import numpy as np
    import scipy.sparse
    import torch
    from test_export import masked_reference, read_export

    out = tmp_path / "csr"
    export(str(pruned_run), "csr", out)
    tensors = read_export(out)
    weights, masks = masked_reference(pruned_run)
    for name, mask in masks.items():
        layer = name.removesuffix(".weight")
        rows, cols = tensors[f"{layer}.shape"].tolist()
        matrix = scipy.sparse.csr_matrix((tensors[f"{layer}.values"].numpy(),
                                          tensors[f"{layer}.col_indices"].numpy(),
                                          tensors[f"{layer}.row_ptr"].numpy()), shape=(rows, cols))
        expected = torch.where(mask, weights[name], 0.0).numpy()
        np.testing.assert_array_equal(matrix.toarray(), expected)


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


@pytest.mark.parametrize("name", ["../outside.txt", "/ABSOLUTE", "sub/../../outside.txt", "./config.json"])
def test_manifest_names_must_stay_inside_the_folder(bitmap_export, tmp_path, capsys, name):
    """Issue 20: on main a manifest listing `../x` or an absolute path had that file opened and hashed."""
    moved = Path(shutil.copytree(bitmap_export, tmp_path / "export"))
    outside = tmp_path / "outside.txt"
    outside.write_text("a file of the user's, beside the export")
    from leapctl.exporters.base import sha256_file

    listed = str(outside) if name == "/ABSOLUTE" else name
    manifest_path = moved / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][listed] = {"sha256": sha256_file(outside), "bytes": outside.stat().st_size}
    manifest_path.write_text(json.dumps(manifest))
    from leapctl.errors import LeapctlError

    with pytest.raises(LeapctlError, match="not a plain relative name inside the folder"):
        validate(moved, end_to_end=False)
    assert run_cli("validate", moved, "--no-end-to-end") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and repr(listed) in lines[0]


def test_a_listed_file_that_is_a_link_out_of_the_folder_fails(damaged, tmp_path):
    from leapctl.exporters.base import sha256_file

    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the export")
    (damaged / "tokenizer.model.link").symlink_to(outside)
    manifest_path = damaged / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["tokenizer.model.link"] = {"sha256": sha256_file(outside),
                                                 "bytes": outside.stat().st_size}
    manifest_path.write_text(json.dumps(manifest))
    assert ("files", "tokenizer.model.link", "a link (leapctl writes none; it is not followed)") in failed(
        validate(damaged, end_to_end=False))


def test_validate_asks_no_server_unless_a_reference_is_given(bitmap_export, tmp_path):
    """Issue 20: on main a manifest whose source was a hub id made validate fetch it. A local server stands
    in for the hub (HF_ENDPOINT) and records every request."""
    import http.server
    import os
    import subprocess
    import sys
    import threading

    requests: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server interface)
            requests.append(self.path)
            self.send_error(404)

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    moved = Path(shutil.copytree(bitmap_export, tmp_path / "moved"))
    manifest_path = moved / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["source"]["path"] = "some-org/some-model"
    manifest_path.write_text(json.dumps(manifest))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HOME": str(tmp_path / "hf")}

    def validate_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "leapctl", "validate", str(moved), "--no-end-to-end",
                               *args], env=env, capture_output=True, text=True, timeout=300)

    try:
        proc = validate_cli()
        assert proc.returncode == 1 and "nothing was compared" in proc.stdout, proc.stdout + proc.stderr
        assert requests == []
        validate_cli("--reference", "some-org/some-model")  # asked for: the hub is asked
        assert requests != []
    finally:
        server.shutdown()
