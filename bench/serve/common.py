"""What the serving benchmarks share: a vLLM server started, checked ready and stopped by `leapctl serve`'s
own launcher (memory sampled), streamed requests, client threads, vLLM's torch profiler; prompts."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from bench.harness import REPO, device_name
from leapctl.commands.serve import running_command


def leapctl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "leapctl", *args], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(request, timeout=timeout)


class Server:
    """A vLLM API server started, checked ready and stopped by `leapctl serve`'s own launcher
    (`running_command`: its own process group), its log in a file, its memory sampled while it runs.

    The sampler must not cost the server it measures: RSS comes from /proc/PID/statm (~0.1 ms a process), and
    PSS, which needs the kernel to walk every page table of the process (psutil's memory_full_info parsed the
    whole smaps: 38-180 ms for a vLLM worker holding the 1B shape, every second, for every server of an
    interleaved run), only with `pss`, from smaps_rollup, every PSS_EVERY samples."""

    PSS_EVERY = 10

    def __init__(self, command: list[str], log: Path, port: int, health: str = "/health",
                 env: dict[str, str] | None = None, pss: bool = False) -> None:
        self.base, self.port, self.command, self.log = f"http://127.0.0.1:{port}", port, command, log
        self.health, self.env = health, env  # env: the server's whole environment (default server_env(1))
        self.pss = pss
        self.process = None
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    @contextmanager
    def running(self, ready_timeout_s: float = 1800):
        """Start the server and yield once it is ready; stop its whole process group on exit."""
        with open(self.log, "w") as log:
            launch = running_command(self.command, self.port, env=self.env, log_file=log, cwd=REPO,
                                     ready_timeout_s=ready_timeout_s, health_path=self.health)
            with launch as process:
                self.process = process
                self._sampler.start()
                try:
                    yield self
                finally:
                    self._stop.set()

    def group(self) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == self.process.pid:
                    found.append(process)
            except (ProcessLookupError, psutil.Error):
                continue
        return found

    def _sample(self) -> None:
        samples = 0
        while not self._stop.wait(1.0):
            with_pss = self.pss and samples % self.PSS_EVERY == 0
            rss = pss = 0
            for process in self.group():
                try:
                    rss += process.memory_info().rss
                    pss += proportional_set_size(process.pid) if with_pss else 0
                except (psutil.Error, OSError):
                    continue
            self.peak_rss = max(self.peak_rss, rss)
            if with_pss:
                self.peak_pss = max(self.peak_pss, pss)
            samples += 1


def stop_servers_on_sigterm() -> None:
    """SIGTERM (kill, a CI's timeout) unwinds like Ctrl-C, so that every running server's process group is
    stopped: by default Python dies without running the `with` blocks that own them, and the servers (4-5 GB
    each) outlive the bench."""
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))


def proportional_set_size(pid: int) -> int:
    """Bytes of PSS of process `pid` (/proc/PID/smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def prompts(tokenizer_dir: Path, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of `length` token ids cut from held-out Wikipedia summaries."""
    from transformers import AutoTokenizer

    from leapctl.data import load_documents

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = []
    for document in load_documents("wiki-summaries-heldout"):
        ids += tokenizer(document, add_special_tokens=False)["input_ids"]
        if len(ids) >= count * length:
            break
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def stream_events(server: Server, body: dict) -> Iterator[dict]:
    """The events of one streamed completion (`body` asks for a stream), as they arrive."""
    with post(f"{server.base}/v1/completions", body) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])


def has_text(event: dict) -> bool:
    """Whether a streamed event carries generated text (a token, on the servers benchmarked here)."""
    return bool(event.get("choices") and event["choices"][0].get("text"))


def run_clients(clients: int, rounds: int, request: Callable[[int], dict]) -> tuple[list[dict], float]:
    """`clients` threads each make `rounds` requests, request(i) for i = client * rounds + round: the
    results and the wall time (s). Raises after all threads end when any request failed."""
    results, errors = [], []

    def client(index: int) -> None:
        try:
            for r in range(rounds):
                results.append(request(index * rounds + r))
        except Exception as exc:  # reported below; a failed request must not hang the run
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return results, wall


PROFILE_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def profile_table(path: Path) -> dict[str, dict]:
    """Op name -> {"self_ms", "total_ms", "calls"} from the key-averages table vLLM's profiler writes."""

    def ms(cell: str) -> float:
        unit = next(u for u in ("us", "ms", "s") if cell.endswith(u))
        return float(cell[: -len(unit)]) * PROFILE_UNITS[unit]

    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().split("  ") if c.strip()]
        if len(cells) == 7 and cells[-1].isdigit():
            rows[cells[0]] = {"self_ms": ms(cells[2]), "total_ms": ms(cells[4]), "calls": int(cells[-1])}
    return rows


def profiled(server: Server, request, folder: Path) -> tuple[dict[str, dict], dict]:
    """`request()` under vLLM's torch profiler (the server started with `--profiler-config` writing to
    `folder`): the op table and its row of the decode steps (their time and number)."""
    for old in folder.glob("*"):
        old.unlink()
    post(f"{server.base}/start_profile", {}).read()
    request()
    post(f"{server.base}/stop_profile", {}).read()
    table = folder / "rank0.profiler_out.txt"
    for _ in range(120):
        if table.is_file() and table.stat().st_size:
            break
        time.sleep(1)
    rows = profile_table(table)
    return rows, next(row for key, row in rows.items()
                      if key.startswith("execute_context") and "generation_1" in key)


def profiler_config(folder: Path) -> list[str]:
    """vLLM's options that make `/start_profile` write its op table (no stacks, plain text) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    return ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(folder),
                                             "torch_profiler_with_stack": False,
                                             "torch_profiler_use_gzip": False})]


def settings(args) -> dict:
    """The run's options (paths as text) and the device, as the results record them."""
    return {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "device": device_name()}
