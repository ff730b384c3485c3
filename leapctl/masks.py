"""The mask file (`masks.safetensors` in a run folder): one packed bitmap per pruned weight, the mask
format every command reads; and `masked_weight`, the one function that zeros pruned weights.

Each tensor is keyed by the weight's name (`model.layers.0.self_attn.q_proj.weight`) and holds
uint8 [rows, ceil(cols/8)], little-endian bits (bit j of byte b is column 8b+j, as compressed-tensors
packs). The metadata carries the model name, the shapes and the sparsity per layer and overall."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from leapctl.errors import LeapctlError
from sparse_formats import pack_rows, unpack_rows

MASK_FORMAT = "leapctl.masks/1"


@dataclass
class MaskSet:
    """Boolean keep-masks by weight name (True = kept) and the file's metadata."""

    masks: dict[str, torch.Tensor]
    model: str = ""
    extra: dict = field(default_factory=dict)

    def sparsity(self) -> dict[str, float]:
        """Fraction of zeros per weight, and `global` over all of them together (exact integer counts,
        not a float32 mean, which is off in the 8th digit)."""
        kept = {name: int(torch.count_nonzero(m)) for name, m in self.masks.items()}
        out = {name: 1.0 - kept[name] / m.numel() for name, m in self.masks.items()}
        total = sum(m.numel() for m in self.masks.values())
        out["global"] = 1.0 - sum(kept.values()) / total if total else 0.0
        return out


def save_masks(path: Path, mask_set: MaskSet) -> None:
    """Write packed bitmaps with shapes and sparsity in the safetensors metadata."""
    tensors = {}
    for name, mask in mask_set.masks.items():
        if mask.dim() != 2:
            raise LeapctlError(f"mask {name} is not 2-D: shape {tuple(mask.shape)}")
        tensors[name] = pack_rows(mask.bool().cpu()).contiguous()
    metadata = {
        "format": MASK_FORMAT,
        "model": mask_set.model,
        "shapes": json.dumps({n: list(m.shape) for n, m in mask_set.masks.items()}),
        "sparsity": json.dumps(mask_set.sparsity()),
        "extra": json.dumps(mask_set.extra),
    }
    save_file(tensors, str(path), metadata=metadata)


def load_masks(path: Path) -> MaskSet:
    """Read a mask file written by `save_masks`; one clear error if it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise LeapctlError(f"mask file {path} does not exist")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        packed = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LeapctlError(f"mask file {path} is not a readable safetensors file: {exc}") from None
    if metadata.get("format") != MASK_FORMAT:
        raise LeapctlError(f"{path} is not a leapctl mask file (format {metadata.get('format')!r})")
    shapes = _metadata_json(path, metadata, "shapes", dict)
    masks = {}
    for name, bits in packed.items():
        rows, cols = _shape(path, shapes, name)
        if tuple(bits.shape) != (rows, (cols + 7) // 8) or bits.dtype != torch.uint8:
            raise LeapctlError(f"mask file {path}: {name} has packed shape {tuple(bits.shape)}, "
                               f"expected {(rows, (cols + 7) // 8)} for a {rows}x{cols} weight")
        masks[name] = unpack_rows(bits, cols)
    extra = _metadata_json(path, metadata, "extra", dict, default="{}")
    return MaskSet(masks=masks, model=metadata.get("model", ""), extra=extra)


def _metadata_json(path: Path, metadata: dict, key: str, kind: type, default: str | None = None):
    """A JSON entry of a mask file's metadata, refused in one line when it is missing, garbage or not a
    `kind` (a file written by hand or damaged)."""
    text = metadata.get(key, default)
    if text is None:
        raise LeapctlError(f"mask file {path}: its metadata has no {key!r}")
    try:
        value = json.loads(text)
    except ValueError:
        raise LeapctlError(f"mask file {path}: its metadata's {key!r} is not valid JSON") from None
    if not isinstance(value, kind):
        raise LeapctlError(f"mask file {path}: its metadata's {key!r} is not a JSON "
                           f"{'object' if kind is dict else kind.__name__}")
    return value


def _shape(path: Path, shapes: dict, name: str) -> tuple[int, int]:
    """The recorded [rows, cols] of weight `name`: two positive integers."""
    if name not in shapes:
        raise LeapctlError(f"mask file {path}: no shape recorded for {name}")
    shape = shapes[name]
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
        raise LeapctlError(f"mask file {path}: the shape recorded for {name} is {shape!r}, not [rows, cols] "
                           f"of two positive integers")
    return shape[0], shape[1]


def masked_weight(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The pruned weight: kept values as they are, +0.0 at pruned positions. The one place that zeros
    pruned weights, so every writer produces the same bits (multiplying by the mask would leave -0.0
    where a negative weight was pruned)."""
    zero = torch.zeros((), dtype=weight.dtype, device=weight.device)
    return torch.where(mask.to(weight.device), weight, zero)


@torch.no_grad()
def apply_masks(model: torch.nn.Module, mask_set: MaskSet) -> None:
    """Zero the pruned weights in place; every mask must name a weight of matching shape."""
    params = dict(model.named_parameters())
    for name, mask in mask_set.masks.items():
        if name not in params:
            raise LeapctlError(f"mask names {name}, which the model does not have")
        weight = params[name]
        if tuple(weight.shape) != tuple(mask.shape):
            raise LeapctlError(f"mask for {name} has shape {tuple(mask.shape)}, "
                               f"weight has {tuple(weight.shape)}")
        weight.copy_(masked_weight(weight, mask))


def check_keeps_weights(mask_set: MaskSet, source: Path | str) -> None:
    """Refuse masks that prune every weight of a layer: no pruning method writes them, and the model they
    make (a layer that outputs only its bias) is broken, not sparse."""
    for name, mask in mask_set.masks.items():
        if not bool(mask.any()):
            raise LeapctlError(f"the masks in {source} prune every weight of {name}; refusing to apply them")


def check_sparsity(sparsity: float) -> None:
    """The one check of a target sparsity (prune, learn, Python callers): strictly between 0 and 1."""
    if not 0.0 < sparsity < 1.0:
        raise LeapctlError(f"--sparsity must be in (0, 1), got {sparsity}")
