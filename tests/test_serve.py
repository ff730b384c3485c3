"""`leapctl serve` end to end on a Llama pruned to 50% by magnitude, 127.0.0.1 only, fp32, greedy.

One stock vLLM server on the dense masked checkpoint gives the reference answers; `leapctl serve` then
serves the bitmap export on one rank (with an API key; most tests) and the csr export on two
tensor-parallel ranks, where q/k/v and gate/up are split by rows and o/down by columns (bitmaps
re-packed per column slice). stories260K cannot be the model: vLLM's CPU attention refuses its
head_dim of 8, so this is a random Llama with head_dim 32 and the stories260K tokenizer."""

import json
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from test_serve_cli import (
    TEST_VLLM_ARGS,
    build_checkpoints,
    free_port,
    greedy_completion,
    http,
    save_tiny_llama,
    sparse_layer_bytes,
    start_leapctl_serve,
    start_stock_vllm,
    stop_leapctl_serve,
    transformers_greedy,
)

from leapctl.commands.serve import running_server

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "Lily wanted to", "The little dog was", "One day, Tom and his mom",
           "The sun was", "Sam had a red ball"]
MAX_TOKENS = 24
API_KEY = "test-key-123"
MEMORY_LINE = r"leap_sparse: (\d+) sparse linear layers hold (\d+) bytes, ([\d.]+)x of (\d+) dense bytes"
CHAT = [{"role": "user", "content": "Once upon a time, there was a girl named"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, stories260k_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), stories260k_dir)


@pytest.fixture(scope="module")
def checkpoints(model_dir, tmp_path_factory):
    """(dense masked, bitmap export)."""
    return build_checkpoints(model_dir, tmp_path_factory.mktemp("bitmap-export"), "bitmap")


@pytest.fixture(scope="module")
def csr_export(model_dir, tmp_path_factory):
    return build_checkpoints(model_dir, tmp_path_factory.mktemp("csr-export"), "csr")[1]


@pytest.fixture(scope="module")
def dense_answers(checkpoints, tmp_path_factory):
    """Greedy answers of stock vLLM on the dense masked checkpoint; its server is stopped afterwards."""
    dense_dir, _ = checkpoints
    server = start_stock_vllm(dense_dir, tmp_path_factory.mktemp("logs") / "dense.log")
    try:
        completions = {p: greedy_completion(server, "dense", p, MAX_TOKENS) for p in PROMPTS}
        status, chat = http("POST", f"{server.base}/v1/chat/completions",
                            {"model": "dense", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert status == 200, chat
    finally:
        server.kill()
    return completions, chat["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def server(checkpoints, dense_answers, tmp_path_factory):
    _, sparse_dir = checkpoints
    running = start_leapctl_serve(sparse_dir, tmp_path_factory.mktemp("logs") / "sparse.log", api_key=API_KEY)
    yield running
    if running.process.poll() is None:  # the two-rank tests stop it earlier
        stop_leapctl_serve(running, signal.SIGHUP)  # a closed terminal stops the group as SIGTERM does


def call(server, path, body=None, api_key=API_KEY):
    return http("POST" if body is not None else "GET", f"{server.base}{path}", body, api_key=api_key)


def test_the_api_key_is_on_no_command_line(server):
    """Issue 20: on main `--api-key KEY` was passed on to vLLM's command line, readable with ps."""
    from pathlib import Path

    pid = server.process.pid
    leader = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
    group = [int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
             if _pgid(stat) == leader]
    assert leader in group
    for member in [pid, *group]:
        assert API_KEY.encode() not in Path(f"/proc/{member}/cmdline").read_bytes(), member
    assert f"VLLM_API_KEY={API_KEY}".encode() in Path(f"/proc/{leader}/environ").read_bytes().split(b"\0")


def _pgid(stat) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def test_models_lists_the_export(server):
    status, body = call(server, "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["sparse"]


def test_greedy_completions_equal_stock_vllm_on_dense_and_transformers(server, checkpoints, dense_answers):
    dense_dir, _ = checkpoints
    for prompt in PROMPTS:
        sparse = greedy_completion(server, "sparse", prompt, MAX_TOKENS, api_key=API_KEY)
        dense = dense_answers[0][prompt]
        assert sparse["token_ids"] == dense["token_ids"], prompt
        assert sparse["text"] == dense["text"]
        reference = transformers_greedy(dense_dir, sparse["prompt_token_ids"], MAX_TOKENS)
        assert sparse["token_ids"] == reference, prompt


def test_chat_completion_equals_stock_vllm(server, dense_answers):
    status, body = call(server, "/v1/chat/completions",
                        {"model": "sparse", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == dense_answers[1]
    assert body["choices"][0]["message"]["content"].strip()


def test_streaming_chat_with_the_openai_client_matches_the_whole_answer(server, dense_answers):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY)
    stream = client.chat.completions.create(model="sparse", messages=CHAT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1, "the answer should arrive in several chunks"
    assert "".join(pieces) == dense_answers[1]


def test_streaming_completion_matches_the_whole_answer(server, dense_answers):
    request = {"model": "sparse", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
               "stream": True}
    status, body = call(server, "/v1/completions", request)
    assert status == 200
    events = [json.loads(line[len("data: "):]) for line in body.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert body.rstrip().endswith("data: [DONE]")
    assert "".join(e["choices"][0]["text"] for e in events) == dense_answers[0][PROMPTS[0]]["text"]


def test_load_64_concurrent_clients_500_requests(server):
    """Every one of 500 concurrent greedy requests answers exactly what a single request answers."""
    single = {p: greedy_completion(server, "sparse", p, 16, api_key=API_KEY)["text"] for p in PROMPTS}
    failures, answers, lock = [], [], threading.Lock()

    def one(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        status, body = call(server, "/v1/completions",
                            {"model": "sparse", "prompt": prompt, "max_tokens": 16, "temperature": 0})
        with lock:
            if status != 200:
                failures.append((i, status, body))
            else:
                answers.append((prompt, body["choices"][0]["text"]))

    with ThreadPoolExecutor(max_workers=64) as pool:
        list(pool.map(one, range(500), timeout=600))  # a hung server fails here instead of stalling CI
    assert not failures, failures[:3]
    assert len(answers) == 500
    assert all(text == single[prompt] for prompt, text in answers)


@pytest.mark.parametrize("body,expected", [
    (b'{"model": "sparse", "prompt": "Once', 400),
    ({"model": "no-such-model", "prompt": "Once", "max_tokens": 4}, 404),
    ({"model": "sparse", "prompt": "Once upon a time " * 200, "max_tokens": 4}, 400),
    ({"model": "sparse", "prompt": "Once", "max_tokens": -1}, 400),
])
def test_bad_requests_get_4xx_with_an_error_body(server, body, expected):
    status, answer = call(server, "/v1/completions", body)
    assert status == expected, answer
    assert isinstance(answer, dict) and answer.get("error", {}).get("message"), answer


def test_requests_without_the_api_key_are_refused(server):
    status, body = call(server, "/v1/models", api_key=None)
    assert status == 401, body
    status, _ = call(server, "/v1/models", api_key="wrong-key")
    assert status == 401


def test_sparse_layers_hold_at_most_0_6x_the_dense_bytes(server, checkpoints):
    """The plugin logs the bytes its loaded layers hold; at 50% they must stay compressed, and with one
    rank they hold exactly the checkpoint's bitmap/values/row_offsets tensors."""
    found = re.search(MEMORY_LINE, server.log())
    assert found, "the plugin did not log its memory figure"
    layers, held, ratio, dense = int(found[1]), int(found[2]), float(found[3]), int(found[4])
    assert layers == 2 * 4  # qkv, o, gate_up, down in each of the 2 blocks
    assert (held, dense) == sparse_layer_bytes(checkpoints[1])
    assert ratio <= 0.6
    print(f"50% sparse: the loaded layers hold {held} bytes = {ratio:.4f}x of {dense} dense bytes")


@pytest.fixture(scope="module")
def tp2_server(csr_export, dense_answers, server, tmp_path_factory):
    """Through the library's `running_server` (what the demo uses). Started after the one-rank server's
    tests (it depends on that fixture, and stops it with SIGTERM, what Docker sends), so only one server
    runs at a time."""
    stop_leapctl_serve(server, signal.SIGTERM)
    log_path = tmp_path_factory.mktemp("logs") / "tp2.log"
    with open(log_path, "w") as log, running_server(csr_export, port=free_port(), tensor_parallel_size=2,
                                                    extra_args=TEST_VLLM_ARGS, log_file=log) as url:
        yield SimpleNamespace(base=url.removesuffix("/v1"), log=lambda: log_path.read_text(errors="replace"))


def test_two_ranks_answer_like_stock_vllm_on_dense_and_transformers(tp2_server, checkpoints, dense_answers):
    for prompt in PROMPTS[:2]:  # two ranks on two shared cores decode slowly
        sparse = greedy_completion(tp2_server, "sparse", prompt, MAX_TOKENS)
        assert sparse["token_ids"] == dense_answers[0][prompt]["token_ids"], prompt
        reference = transformers_greedy(checkpoints[0], sparse["prompt_token_ids"], MAX_TOKENS)
        assert sparse["token_ids"] == reference, prompt


def test_two_ranks_serve_chat_and_models(tp2_server, dense_answers):
    status, body = http("GET", f"{tp2_server.base}/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["sparse"]
    status, body = http("POST", f"{tp2_server.base}/v1/chat/completions",
                        {"model": "sparse", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200 and body["choices"][0]["message"]["content"] == dense_answers[1], body


def test_each_of_two_ranks_holds_its_compressed_part(tp2_server):
    figures = re.findall(MEMORY_LINE, tp2_server.log())
    assert len(figures) == 2, "each of the two ranks logs what its layers hold"
    for layers, _, ratio, _ in figures:
        assert int(layers) == 2 * 4 and float(ratio) <= 0.6
