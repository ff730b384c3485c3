"""What every export target shares: the `Exporter` interface and its registry, the validation report the
targets' checks fill in, and the file helpers (safetensors shards, checksums, the masked reference model).

An exporter is one module (like one vLLM quantization method): it has a name, writes its files, reads
them back, and knows the checks that prove its files equal the pruned model. `leapctl export` and
`leapctl validate` only loop over the registry."""

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from leapctl.compute import dtype_name
from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet, apply_masks
from leapctl.runs import Run

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "leapctl.export/1"
INDEX_FILE = "model.safetensors.index.json"
PROMPTS = ["Once upon a time", "The little dog", "One day, a girl named Lily"]


@dataclass
class ExportOptions:
    max_shard_bytes: int
    dtype: torch.dtype | None  # cast floating tensors to this first; None keeps the source's


@dataclass
class Written:
    """What a writer reports for the manifest: per pruned layer, totals, and its own extra entries."""

    layers: dict[str, dict]
    totals: dict[str, int]
    extra: dict = field(default_factory=dict)


@dataclass
class Check:
    kind: str
    target: str
    ok: bool | None  # None: skipped
    detail: str = ""


@dataclass
class Report:
    export_dir: Path
    fmt: str
    checks: list[Check] = field(default_factory=list)

    def add(self, kind: str, target: str, ok: bool | None, detail: str = "") -> None:
        self.checks.append(Check(kind, target, ok, detail))

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]


@dataclass
class Reference:
    """The pruned model an export must equal: the source folder, its masks and its tensors."""

    spec: str
    run: Run
    dtype: torch.dtype | None  # the export's cast, applied to the reference before comparing
    tensors: dict[str, torch.Tensor]

    @property
    def masks(self) -> MaskSet:
        return self.run.masks

    def weight(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor


@dataclass
class ValidateOptions:
    end_to_end: bool = True
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    max_new_tokens: int = 12
    seed: int = 0


class Exporter(ABC):
    """One export target. Subclasses set `name` and `summary` and implement `write`, `read` and `check`."""

    name: str = ""
    summary: str = ""
    value_dtypes: tuple[torch.dtype, ...] = ()  # dtypes the format can store; () means any float dtype
    servable: bool = False  # `leapctl serve` loads it
    manifest_lists: tuple[str, ...] = ()  # lists of names its manifest must hold (read_manifest checks them)
    layer_tensors: bool = True  # each manifest layer lists its tensors (a graph format folds them in)

    @abstractmethod
    def write(self, source: Run, out: Path, options: ExportOptions) -> Written:
        """Write the export's files (not the manifest) into `out`."""

    @abstractmethod
    def read(self, export_dir: Path, manifest: dict, report: Report | None = None) -> dict[str, torch.Tensor]:
        """The stored tensors by name; problems (an unreadable file, a misplaced tensor) go to `report`."""

    @abstractmethod
    def check(self, export_dir: Path, manifest: dict, reference: Reference | None, report: Report,
              options: ValidateOptions) -> None:
        """Add this target's checks to `report` (the files check has already run)."""

    def check_source(self, source: Run) -> None:
        """Raise LeapctlError when this target cannot export `source` at all (before anything is written);
        most targets export any run."""
        return None

    def cast_for(self, source: torch.dtype, requested: torch.dtype | None) -> tuple[torch.dtype | None, str]:
        """The dtype to cast the weights to (None: keep them) and, when that was not asked for, why."""
        if requested is not None:
            if self.value_dtypes and requested not in self.value_dtypes:
                names = " or ".join(dtype_name(d) for d in self.value_dtypes)
                raise LeapctlError(f"{self.name} stores {names} values, not {dtype_name(requested)}")
            return requested, ""
        if self.value_dtypes and source not in self.value_dtypes:
            target = self.value_dtypes[0]
            return target, (f"{self.name} stores {dtype_name(target)} values: casting the "
                            f"{dtype_name(source)} weights (--dtype chooses another)")
        return None, ""


EXPORTERS: dict[str, Exporter] = {}


def register(exporter: Exporter) -> Exporter:
    EXPORTERS[exporter.name] = exporter
    return exporter


# ---------------------------------------------------------------- file helpers the targets share


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order when sharded."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            names = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, no map, not a map
            raise LeapctlError(f"{index} is not a safetensors index (a JSON object with a weight_map)"
                               ) from None
        if not all(isinstance(name, str) and "/" not in name and name not in ("", ".", "..")
                   for name in names):
            raise LeapctlError(f"{index} names a weight file that is not a plain file name in {folder}")
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise LeapctlError(f"{folder} has no safetensors weights (model.safetensors or {INDEX_FILE})")


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder by name; one clear error for an unreadable file."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise LeapctlError(f"cannot read {file}: {exc}") from None
    return tensors


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64}


def pruned_dtype(source: Run) -> torch.dtype:
    """The stored dtype of the source's pruned weights (what a cast decision is about), read from the
    safetensors headers without loading any tensor."""
    for file in weight_files(source.path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                stored = {name: handle.get_slice(name).get_dtype() for name in source.masks.masks
                          if name in handle.keys()}
        except (SafetensorError, OSError) as exc:
            raise LeapctlError(f"cannot read {file}: {exc}") from None
        for name, dtype in stored.items():
            if dtype not in SAFETENSORS_DTYPES:
                raise LeapctlError(f"{source.spec}: {name} is stored as {dtype}, not a float dtype")
            return SAFETENSORS_DTYPES[dtype]
    raise LeapctlError(f"the masks of {source.spec} name no weight of its checkpoint")


def linear_names(config) -> list[str]:
    """Qualified names of every nn.Linear in the model, found on the meta device (no weights loaded)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def source_config(source: Run):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.path)
    except Exception as exc:  # transformers raises many types for unreadable configs
        raise LeapctlError(f"cannot read the config of {source.spec}: {exc}") from None


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", text.upper())
    if not match:
        raise LeapctlError(f"cannot read the size {text!r} (examples: 5GB, 500MB, 2GiB)")
    number, unit = float(match.group(1)), (match.group(2) or "B")
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    size = int(number * base**power)
    if size < 1:  # 0 would put every module in a shard of its own
        raise LeapctlError(f"the size {text!r} is less than one byte")
    return size


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes` (a module's tensors stay together),
    named as Hugging Face names them, with the index file when there is more than one."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, group: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in group.values())
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending.update({name: t.contiguous() for name, t in group.items()})
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f".shard-{len(self.written)}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        """Rename the shards to their final names; returns the weight map."""
        self.flush()
        count = len(self.written)
        weight_map = {}
        for number, (path, names) in enumerate(self.written, start=1):
            final = "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_masked_model(path: Path, mask_set: MaskSet, dtype: torch.dtype):
    """The source model with its pruned weights zeroed, in eval mode: what an export must reproduce."""
    from leapctl.models import load_model

    model, tokenizer = load_model(str(path), dtype=dtype)
    apply_masks(model, mask_set)
    return model, tokenizer


def sample_ids(tokenizer, prompts: list[str]) -> torch.Tensor:
    """One batch of equally long prompts (truncated to the shortest) so that no padding is needed."""
    encoded = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
    length = min(len(e) for e in encoded)
    return torch.stack([e[:length] for e in encoded])


def bit_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    """'' when equal bit for bit, else how many elements differ and where the first is."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return (f"decodes to {got.dtype} {tuple(got.shape)}, "
                f"reference is {expected.dtype} {tuple(expected.shape)}")
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    differs = got.contiguous().view(as_int) != expected.contiguous().view(as_int)
    if not bool(differs.any()):
        return ""
    first = differs.nonzero()[0].tolist()
    return (f"{int(differs.sum())} of {differs.numel()} weights differ from the reference, first at "
            f"{tuple(first)}: {got[tuple(first)].item()} vs {expected[tuple(first)].item()}")


def compute_paths(report: Report, op: str) -> dict[str, Callable[[], AbstractContextManager]]:
    """The ways serving can multiply a layer here, each as a context to run it in: "decode" (the portable op)
    and the native CPU kernel `op` on every instruction set this CPU runs; a kernel that cannot be built or
    lacks `op` is reported as not checked."""
    from serving import cpu_kernel

    paths: dict[str, Callable[[], AbstractContextManager]] = {"decode": nullcontext}
    try:
        native = cpu_kernel.load() and hasattr(torch.ops.leap_sparse_cpu, op)
    except ValueError as exc:  # a bad LEAP_SPARSE_CPU_ISA
        raise LeapctlError(str(exc)) from None
    if native:
        paths |= {isa: partial(cpu_kernel.using_isa, isa) for isa in cpu_kernel.supported_isas()}
    else:
        report.add("sparse-linear", "native CPU kernel", None,
                   f"not checked: {cpu_kernel.unavailable_reason() or f'no {op} op'}")
    return paths
