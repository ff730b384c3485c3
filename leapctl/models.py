"""Finding, loading and inspecting causal LMs: local Hugging Face folders, hub ids, built-in names.

Prunable layers are the `nn.Linear` modules inside the decoder blocks (q, k, v, o, gate, up, down);
embeddings and `lm_head` are never pruned."""

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from leapctl.errors import LeapctlError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "gemma3_text", "gemma3")


def resolve_model(spec: str) -> Path:
    """Turn a MODEL argument into a local checkpoint folder: built-in name, local folder or hub id."""
    from leapctl.builtin_models import BUILTIN_MODELS, materialize_builtin

    if spec in BUILTIN_MODELS:
        return materialize_builtin(spec)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise LeapctlError(f"{path} is not a Hugging Face checkpoint folder (no config.json)")
        return path
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise LeapctlError(f"model {spec!r} is neither a local folder, a built-in name "
                           f"({', '.join(BUILTIN_MODELS)}) nor a hub id (owner/name)")
    return _download_from_hub(spec)


def _download_from_hub(repo_id: str) -> Path:
    """The real hub loader; offline it fails with one line instead of a traceback."""
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # the hub client raises many types for network and auth problems
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LeapctlError(f"could not fetch {repo_id!r} from the Hugging Face hub: {reason}") from None


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load (model, tokenizer) in eval mode; one clear error for missing, corrupt or unsupported models."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise LeapctlError(f"cannot read the config of {spec}: {_first_line(exc)}") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise LeapctlError(f"unsupported architecture {config.model_type!r} in {spec} "
                           f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise LeapctlError(f"cannot load the model {spec}: {_first_line(exc)}") from None
    model.to(device).eval()
    model.name_or_path = spec
    return model, tokenizer


def checkpoint_dtype(spec: str) -> torch.dtype:
    """The dtype a checkpoint's config declares (a bf16 model stays bf16 when rewritten); float32 when it
    declares none. An unreadable config is left for `load_model` to report in its own words."""
    from transformers import AutoConfig

    path = resolve_model(spec)
    try:
        dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    except Exception:  # transformers raises many types for unreadable configs
        return torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks of a Llama, Qwen2 or Gemma3 causal LM."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None and inner is not None:  # multimodal wrappers keep the text model one level deeper
        layers = getattr(getattr(inner, "language_model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise LeapctlError(f"cannot find decoder blocks in {type(model).__name__}")
    return layers


@dataclass(frozen=True)
class ModelLayout:
    """What pruning works on, found once per model and passed to whoever needs it: the decoder blocks,
    their qualified name (`model.layers`) and the prunable linears by qualified name, in model order."""

    prefix: str
    blocks: nn.ModuleList
    linears: dict[str, nn.Linear]

    def block_index(self, name: str) -> int:
        """The decoder block of a layer or weight name (`model.layers.3.mlp.up_proj.weight` -> 3)."""
        if not name.startswith(self.prefix + "."):
            raise ValueError(f"{name} is not inside {self.prefix}")
        return int(name[len(self.prefix) + 1:].split(".", 1)[0])

    def block_linears(self, index: int) -> dict[str, nn.Linear]:
        """The prunable linears of decoder block `index` (empty when include/exclude left none)."""
        return {name: linear for name, linear in self.linears.items() if self.block_index(name) == index}


def model_layout(model: nn.Module, include: str | None = None, exclude: str | None = None) -> ModelLayout:
    """The model's layout; prunable linears are the `nn.Linear` modules inside the decoder blocks,
    filtered by optional regexes (`re.search` on the qualified name)."""
    blocks = decoder_blocks(model)
    prefix = next((name for name, module in model.named_modules() if module is blocks), None)
    if prefix is None:
        raise LeapctlError("decoder blocks are not reachable by name")
    inc = re.compile(include) if include else None
    exc = re.compile(exclude) if exclude else None
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not name.startswith(prefix + "."):
            continue
        if inc and not inc.search(name):
            continue
        if exc and exc.search(name):
            continue
        found[name] = module
    if not found:
        raise LeapctlError("no prunable linear layers matched (check --include/--exclude)")
    return ModelLayout(prefix=prefix, blocks=blocks, linears=found)


def final_norm(model: nn.Module, layout: ModelLayout) -> nn.Module:
    """The norm between the last decoder block and lm_head: the `norm` beside the blocks (Llama, Qwen2,
    Gemma3 all name it so)."""
    owner = model.get_submodule(layout.prefix.rsplit(".", 1)[0]) if "." in layout.prefix else model
    norm = getattr(owner, "norm", None)
    if not isinstance(norm, nn.Module):
        raise LeapctlError(f"cannot find the final norm of {type(model).__name__} (no `norm` beside its "
                           f"decoder blocks)")
    return norm


def untie_output_embeddings(model: nn.Module) -> bool:
    """Give the input embedding its own copy of a weight it shares with lm_head, so that rounding lm_head
    leaves the embedding's values as they are (a lookup reads one row a token: its bytes do not matter);
    returns whether they were tied."""
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or table is None or head.weight is not table.weight:
        return False
    table.weight = nn.Parameter(table.weight.detach().clone(), requires_grad=table.weight.requires_grad)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    return True


def prunable_linears(model: nn.Module, include: str | None = None,
                     exclude: str | None = None) -> dict[str, nn.Linear]:
    """Shorthand for `model_layout(model, include, exclude).linears`."""
    return model_layout(model, include, exclude).linears


def recompute_blocks_in_backward(model: nn.Module) -> list[nn.Module]:
    """Turn on Hugging Face's recomputation of each decoder block in the backward; returns the modules that
    decide it (the blocks, or the model in older transformers), put in training mode because Hugging Face
    recomputes only there. Their own flag alone: attention and dropout modules stay in eval mode."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    deciding = [module for module in model.modules() if getattr(module, "gradient_checkpointing", False)]
    for module in deciding:
        module.training = True
    return deciding
