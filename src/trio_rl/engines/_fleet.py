"""An inference fleet: one engine over several OpenAI-compatible servers (vLLM, SGLang).

The fleet balances requests across its servers (least loaded, a group's samples together),
takes out a server that stops answering and retries its requests elsewhere, probes it and takes
it back once it has loaded the current weights, and reloads every live server before a new
policy version counts. Nothing here imports vLLM: each server is another process, reached over
HTTP; weight reloads use the admin endpoints of :class:`~trio_rl.engines.VLLMAdmin` (servers
started with ``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal

import attrs
import httpx
import trio
import trio_util

from .._validation import a_bool, http_urls, positive_or_inf, url_tuple
from ..errors import collapse_single
from ..policy import PolicyVersionCell
from ..samples import PolicyVersion
from ._abort import stop_scope
from ._errors import (
    EngineConfigError,
    EngineError,
    EngineTimeoutError,
    EngineTransportError,
)
from ._fleet_config import abort_path_check
from ._fleet_config import fleet_default as _d
from ._fleet_member import Member as _Server
from ._fleet_status import FleetEvent, FleetServer
from ._openai import OpenAICompatibleEngine
from ._protocol import Completion, GenerateRequest
from ._waiting import LogThrottle, wait_logged

__all__ = ["EngineFleet", "open_engine_fleet"]

logger = logging.getLogger("trio_rl.engines")


_COUNTS = ("requests", "retried", "failed", "taken_out", "taken_in", "weight_loads")


def _quorum(fleet: EngineFleet, attribute: attrs.Attribute[Any], value: object) -> None:
    """``min_servers``: None, or 1 to the number of urls."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= len(fleet.urls):
        raise EngineConfigError(
            f"EngineFleet.min_servers must be None or an int in 1..{len(fleet.urls)} "
            f"(the number of urls), got {value!r}"
        )


@attrs.define(slots=True, eq=False, kw_only=True)
class EngineFleet:
    """An :class:`~trio_rl.engines.Engine` over several OpenAI-compatible servers that serve the
    same model; open it with :func:`open_engine_fleet`.

    **Balancing.** A request goes to the live server with the fewest requests in flight. A
    request with a :attr:`~trio_rl.engines.GenerateRequest.routing_key` goes where the key's
    first request went, while that server is live: under group-sticky routing
    (``RolloutConfig(routing_keys="group")``) all samples of a group land on one server, which
    computes their shared prompt once (prefix cache). The key also travels as the
    ``X-SMG-Routing-Key`` header. The fleet remembers the last ``max_keys`` keys.

    **A server that stops answering** is taken out: at once when a request to it fails with a
    transport error (a refused or dropped connection, a 5xx answer), or after
    ``probe_failures`` health probes in a row fail (``GET /health`` every ``probe_interval``
    seconds, each bounded by ``probe_timeout``: a server that hangs). Its requests in flight
    are cancelled and retried on another live server, each counted in ``retried`` of
    :meth:`statistics`; a request is tried on at most ``max_attempts`` servers, then
    :class:`EngineTransportError`. With no server live, a request waits up to
    ``wait_for_server`` seconds for one (:class:`EngineTransportError` after that).

    **Taken back in.** A server taken out is probed every ``probe_interval`` seconds; once it
    answers, it loads the current weights (those of the last :meth:`load_weights`: it may be a
    restarted process serving the model it started with) and resets its prefix cache, and only
    then takes requests again.

    **Weights and the policy version.** :meth:`load_weights` reloads every live server (vLLM's
    ``/collective_rpc`` ``reload_weights``, then ``/reset_prefix_cache``) and only then makes
    the version current (``version``): a new policy version counts once every live server has
    it. A completion is stamped with the version current when its request was sent (never
    fresher than the weights that produced it). A server that fails its reload with a transport
    error or a timeout is taken out (it loads the weights when it comes back); a refused reload
    (4xx) raises.

    **Deadlines.** Each request, retries included, runs under ``trio.fail_after(timeout)``
    (:class:`EngineTimeoutError`); every admin call under ``admin_timeout``; opening waits at
    most ``start_timeout`` for every server (or ``min_servers`` of them) to answer ``/health``.

    **Starting with a quorum.** With ``min_servers``, the fleet opens once that many servers
    answer; the others start taken out and are probed in like a server that came back. With
    ``check_models``, a server joining later must serve the models the others serve: one that
    serves others stays out (logged, and a ``refused`` event).

    **Cancellation.** A cancelled request is abandoned (the response closed: vLLM aborts a
    request whose client left) and ``trio.Cancelled`` propagates; leaving
    :func:`open_engine_fleet` stops the probes and closes every client. A cancelled
    :meth:`load_weights` leaves the version where it was.
    """

    urls: tuple[str, ...] = attrs.field(converter=url_tuple, validator=http_urls, kw_only=False)
    model: str = "default"
    timeout: float = attrs.field(default=_d("timeout"), validator=positive_or_inf)
    max_attempts: int = attrs.field(default=_d("max_attempts"), validator=positive_or_inf)
    wait_for_server: float = attrs.field(default=_d("wait_for_server"), validator=positive_or_inf)
    start_timeout: float = attrs.field(default=_d("start_timeout"), validator=positive_or_inf)
    admin_timeout: float = attrs.field(default=_d("admin_timeout"), validator=positive_or_inf)
    probe_interval: float = attrs.field(default=_d("probe_interval"), validator=positive_or_inf)
    probe_timeout: float = attrs.field(default=_d("probe_timeout"), validator=positive_or_inf)
    probe_failures: int = attrs.field(default=_d("probe_failures"), validator=positive_or_inf)
    #: Ask the servers for streamed answers (see :class:`OpenAICompatibleEngine`).
    stream: bool = attrs.field(default=True, validator=a_bool)
    #: SGLang's ``/abort_request`` (a cancelled request's, and :meth:`abort_all`'s); None: vLLM.
    abort_path: str | None = attrs.field(default=_d("abort_path"), validator=abort_path_check)
    #: Merged into every request body.
    extra_body: Mapping[str, Any] = attrs.field(factory=dict)
    #: Sent with every request and admin call (e.g. ``{"Authorization": "Bearer ..."}``); not
    #: in the repr. A 401 or 403 (``EngineAuthError``) at opening fails it at once.
    headers: Mapping[str, str] = attrs.field(factory=dict, repr=False)
    #: The header that carries the routing key (None: not sent).
    routing_header: str | None = "X-SMG-Routing-Key"
    #: Routing keys remembered (least recently used forgotten first).
    max_keys: int = attrs.field(default=65536, validator=positive_or_inf)
    #: Check at opening that every server serves the same models (``GET /v1/models``), and
    #: ``model`` among them; ``"default"`` becomes the first model they list.
    check_models: bool = attrs.field(default=True, validator=a_bool)
    #: How many servers must answer at opening (None: all of them); the others start taken
    #: out and are probed in like a server that came back (after the model check).
    min_servers: int | None = attrs.field(default=None, validator=_quorum)
    #: The policy-version cell this fleet advances; pass the pipeline's to share it.
    version: PolicyVersionCell = attrs.field(factory=PolicyVersionCell)

    _servers: list[_Server] = attrs.field(init=False, factory=list)
    _keys: OrderedDict[str, _Server] = attrs.field(init=False, factory=OrderedDict)
    #: the URLs of the live servers
    _live: trio_util.AsyncValue[frozenset[str]] = attrs.field(
        init=False, factory=lambda: trio_util.AsyncValue(frozenset())
    )
    _weights_lock: trio.Lock = attrs.field(init=False, factory=trio.Lock)
    _weights: tuple[str, PolicyVersion] | None = attrs.field(init=False, default=None)
    _open: bool = attrs.field(init=False, default=False)
    _events: deque[FleetEvent] = attrs.field(init=False, factory=lambda: deque(maxlen=10_000))
    _counts: dict[str, int] = attrs.field(init=False, factory=lambda: dict.fromkeys(_COUNTS, 0))
    #: one "no server is live" line per 10 s, however many requests wait
    _no_server_log: LogThrottle = attrs.field(init=False, factory=LogThrottle)
    #: what the servers checked at opening serve (with ``check_models``)
    _models: list[str] | None = attrs.field(init=False, default=None)

    @property
    def policy_version(self) -> PolicyVersion:
        return self.version.value

    def set_policy_version(self, version: PolicyVersion) -> None:
        """Make ``version`` current without a reload (e.g. the servers started on it)."""
        self.version.advance(version)

    def servers(self) -> list[FleetServer]:
        """Every server's state, in the order of ``urls``."""
        return [s.status() for s in self._servers]

    def live(self) -> list[str]:
        """The URLs of the servers taking requests now, in the order of ``urls``."""
        return [s.url for s in self._servers if s.state == "live"]

    async def wait_live(self, urls: Collection[str], *, timeout: float) -> None:  # noqa: ASYNC109
        """Wait until exactly ``urls`` are live; :class:`EngineTimeoutError` after
        ``timeout`` seconds, naming what is live. Cancellation: the wait ends."""
        want = frozenset(u.rstrip("/") for u in urls)
        with trio.move_on_after(timeout):
            await self._live.wait_value(lambda live: live == want)
            return
        raise EngineTimeoutError(
            f"servers {sorted(want)} were not (the only ones) live within {timeout}s; "
            f"live: {self.live()}"
        )

    def events(self) -> list[FleetEvent]:
        """What happened to the servers (the last 10,000 events), oldest first."""
        return list(self._events)

    def statistics(self) -> dict[str, int]:
        """Counters since opening: ``requests``; ``retried`` (attempts moved to another server
        after theirs failed or was taken out); ``failed`` (requests that gave up: no server
        left, or ``max_attempts`` tried); ``taken_out``, ``taken_in``; ``weight_loads``."""
        return dict(self._counts)

    async def generate(self, request: GenerateRequest) -> Completion:
        """One completion from one of the servers; see the class docstring for balancing,
        retries, deadlines and cancellation (``trio.Cancelled`` propagates)."""
        if not self._open:
            raise trio.ClosedResourceError("EngineFleet used outside open_engine_fleet()")
        self._counts["requests"] += 1
        try:
            return await self._generate(request)
        except EngineError:
            self._counts["failed"] += 1
            raise

    async def _generate(self, request: GenerateRequest) -> Completion:
        failures: list[str] = []
        try:
            with trio.fail_after(self.timeout):
                for attempt in range(self.max_attempts):
                    server = await _pick(self, request, failures)
                    if server is None:  # aborted while waiting for a live server
                        return Completion([], [], "abort", self.version.value)
                    if attempt:
                        self._counts["retried"] += 1
                    outcome = await self._on(server, request)
                    if isinstance(outcome, Completion):
                        return outcome
                    failures.append(outcome)
        except trio.TooSlowError:
            raise EngineTimeoutError(
                f"request {request.request_id!r} did not finish within {self.timeout}s"
                + (f" ({'; '.join(failures)})" if failures else "")
            ) from None
        raise EngineTransportError(
            f"request {request.request_id!r} failed on {self.max_attempts} servers: "
            + "; ".join(failures)
        )

    async def _on(self, server: _Server, request: GenerateRequest) -> Completion | str:
        """One attempt on ``server``: the completion (stamped with the version current when it
        was sent), or why it failed (the server is then out)."""
        version = self.version.value
        scope = trio.CancelScope()
        server.in_flight += 1
        server.requests += 1
        server.scopes.add(scope)
        reason = f"{server.url} was taken out while the request ran"
        try:
            with scope:
                completion = await server.engine.generate(request)
                return attrs.evolve(completion, policy_version=version)
        except EngineTransportError as exc:
            # the server's engine already sent a request again whose pooled connection the
            # server had closed: this failure is the server's
            reason = str(exc)
        finally:
            server.in_flight -= 1
            server.scopes.discard(scope)
        server.failures += 1
        _take_out(self, server, reason)
        return reason

    async def load_weights(self, path: str | os.PathLike[str], version: PolicyVersion) -> None:
        """Reload every live server from the safetensors directory ``path`` (readable by the
        servers) as policy ``version``, reset their prefix caches, then make ``version``
        current. Servers that fail with a transport error or a timeout are taken out and load
        these weights when they come back; :class:`EngineTransportError` if no server loaded
        them. A refused reload raises :class:`EngineRequestError`; ``ValueError`` if
        ``version`` goes back. Cancellation: the version stays where it was (some servers may
        have the new weights already; they report the old version until a load completes)."""
        self.version.check(version)
        where = os.fspath(path)
        async with self._weights_lock:
            live = [s for s in self._servers if s.state == "live"]
            loaded: list[_Server] = []
            refused: list[EngineError] = []

            async def load(server: _Server) -> None:
                try:
                    await _reload(self, server, where, version)
                except (EngineTransportError, EngineTimeoutError) as exc:
                    _take_out(self, server, f"weight reload failed: {exc}")
                except EngineError as exc:
                    refused.append(exc)
                else:
                    loaded.append(server)

            async with trio.open_nursery() as nursery:
                for server in live:
                    nursery.start_soon(load, server)
            if refused:
                raise refused[0]
            if not loaded:
                raise EngineTransportError(
                    f"no live server loaded the weights {where} (version {version}); "
                    f"servers: {', '.join(f'{s.url} {s.state}' for s in self._servers)}"
                )
            self._weights = (where, version)
            self.version.advance(version)
            self._counts["weight_loads"] += 1

    def take_out(self, url: str, reason: str) -> None:
        """Take the server at ``url`` out now (e.g. its process exited: a launcher knows before
        any probe does); it is probed back in like any server taken out."""
        for server in self._servers:
            if server.url == url.rstrip("/"):
                _take_out(self, server, reason)
                return
        raise EngineConfigError(f"{url} is not a server of this fleet ({list(self.urls)})")

    async def abort_all(self) -> None:
        """Abort every request running on the live servers at once (see `_abort_all`)."""
        await _abort_all(self)


async def _abort_all(fleet: EngineFleet) -> None:
    """`EngineFleet.abort_all`: miles' ``abort_all`` of every worker, i.e.
    :meth:`OpenAICompatibleEngine.abort_all` of each live server (SGLang: ``{"abort_all":
    true}`` posted to ``abort_path``; vLLM: nothing, its requests abort as they disconnect)."""
    if not fleet._open:
        raise trio.ClosedResourceError("EngineFleet used outside open_engine_fleet()")
    async with trio.open_nursery() as nursery:
        for server in (s for s in fleet._servers if s.state == "live"):
            nursery.start_soon(server.engine.abort_all)


async def _pick(
    fleet: EngineFleet, request: GenerateRequest, failures: list[str]
) -> _Server | None:
    """The server for ``request`` (its key's, else the least loaded); waits for one to be
    live up to ``wait_for_server``; None if the request's abort was set meanwhile."""
    key = request.routing_key
    if key is not None:
        pinned = fleet._keys.get(key)
        if pinned is not None and pinned.state == "live":
            fleet._keys.move_to_end(key)
            return pinned
    if not fleet._live.value:
        with stop_scope(request.abort) as stopped:
            await wait_logged(
                lambda: fleet._live.wait_value(bool),
                f"a live inference server (none of {list(fleet.urls)} is live; requests wait)",
                fleet.wait_for_server,
                throttle=fleet._no_server_log,
            )
        if stopped.cancelled_caught:
            return None
        if not fleet._live.value:
            raise EngineTransportError(
                f"request {request.request_id!r}: no server of {list(fleet.urls)} was live "
                f"for {fleet.wait_for_server}s" + (f" ({'; '.join(failures)})" if failures else "")
            )
    live = [s for s in fleet._servers if s.state == "live"]
    server = min(live, key=lambda s: (s.in_flight, s.requests))
    if key is not None:
        fleet._keys[key] = server
        fleet._keys.move_to_end(key)
        if len(fleet._keys) > fleet.max_keys:
            fleet._keys.popitem(last=False)
    return server


async def _reload(fleet: EngineFleet, server: _Server, path: str, version: PolicyVersion) -> None:
    await server.admin.reload_weights(path)
    await server.admin.reset_prefix_cache()
    server.loaded = version
    fleet._events.append(FleetEvent(trio.current_time(), server.url, "loaded", version, path))


def _take_out(fleet: EngineFleet, server: _Server, reason: str) -> None:
    """Take ``server`` out of rotation: its requests in flight are cancelled (and retried
    elsewhere by their callers); the probes bring it back."""
    if server.state != "live":
        return
    server.state = "out"
    server.loaded = None  # it may come back as a new process, with the model it started on
    server.taken_out += 1
    server.probe_failures = 0
    fleet._counts["taken_out"] += 1
    fleet._live.value = fleet._live.value - {server.url}
    fleet._events.append(FleetEvent(trio.current_time(), server.url, "out", None, reason))
    logger.warning("inference server %s taken out: %s", server.url, reason)
    for scope in list(server.scopes):
        scope.cancel()


async def _probe(fleet: EngineFleet, server: _Server) -> Literal["ok", "failed", "refused"]:
    """``GET /health`` within ``probe_timeout``: ``refused`` when nothing listens on the
    server's port (the process is gone: no need to wait for a second probe)."""
    with trio.move_on_after(fleet.probe_timeout):
        try:
            await server.admin._call("GET", "/health")
        except EngineTransportError as exc:
            refused = isinstance(exc.__cause__, httpx.ConnectError)
            return "refused" if refused else "failed"
        except EngineError:
            return "failed"
        return "ok"
    return "failed"


async def _watch(fleet: EngineFleet, server: _Server) -> None:
    """Probe ``server`` forever: take it out after ``probe_failures`` failed probes in a
    row; bring it back in once it answers and has loaded the current weights."""
    while True:
        await trio.sleep(fleet.probe_interval)
        probe = await _probe(fleet, server)
        if server.state == "live":
            if probe == "refused":
                _take_out(fleet, server, "its port refuses connections")
                continue
            server.probe_failures = 0 if probe == "ok" else server.probe_failures + 1
            if server.probe_failures >= fleet.probe_failures:
                _take_out(fleet, server, f"{server.probe_failures} health probes in a row failed")
        elif server.state == "out" and probe == "ok":
            await _bring_back(fleet, server)


async def _serves_the_model(fleet: EngineFleet, server: _Server) -> bool:
    """Whether a server that joins after opening serves what the fleet's servers serve; a
    refusal is logged and reported (a ``refused`` event) once per answer it gave."""
    if fleet._models is None or server.checked:
        return True
    served = sorted(await server.admin.models())
    if served == fleet._models:
        server.checked = True
        server.refused = None
        return True
    if served != server.refused:
        server.refused = served
        detail = f"serves {served}, the fleet serves {fleet._models}"
        fleet._events.append(FleetEvent(trio.current_time(), server.url, "refused", None, detail))
        logger.warning("inference server %s answers but stays out: it %s", server.url, detail)
    return False


async def _bring_back(fleet: EngineFleet, server: _Server) -> None:
    async with fleet._weights_lock:
        server.state = "loading"
        try:
            if not await _serves_the_model(fleet, server):
                server.state = "out"
                return
            if fleet._weights is not None:
                path, version = fleet._weights
                await _reload(fleet, server, path, version)
        except EngineError as exc:
            server.state = "out"
            logger.warning(
                "inference server %s answers again but could not load the current weights: %s",
                server.url,
                exc,
            )
            return
        except BaseException:
            server.state = "out"
            raise
        server.state = "live"
        server.taken_in += 1
        fleet._counts["taken_in"] += 1
        fleet._live.value = fleet._live.value | {server.url}
        fleet._events.append(FleetEvent(trio.current_time(), server.url, "in", server.loaded, ""))
        logger.warning(
            "inference server %s taken back in (weights of version %s)",
            server.url,
            "as started" if server.loaded is None else server.loaded,
        )


async def _check_servers(fleet: EngineFleet) -> list[_Server]:
    """Wait until every server (or ``min_servers`` of them) answers ``/health`` within
    ``start_timeout`` and, with ``check_models``, check that those serve the same models;
    the servers that answered, in the order of ``urls``."""
    models: dict[str, list[str]] = {}
    need = len(fleet._servers) if fleet.min_servers is None else fleet.min_servers

    async def check(server: _Server, nursery: trio.Nursery) -> None:
        try:
            await server.admin.wait_healthy(fleet.start_timeout, poll_interval=0.25)
        except EngineTimeoutError:
            if fleet.min_servers is None:
                raise
            return
        models[server.url] = sorted(await server.admin.models()) if fleet.check_models else []
        if len(models) >= need:
            nursery.cancel_scope.cancel()

    with collapse_single():
        async with trio.open_nursery() as nursery:
            for server in fleet._servers:
                nursery.start_soon(check, server, nursery)
    ready = [s for s in fleet._servers if s.url in models]
    if len(ready) < need:
        missing = [s.url for s in fleet._servers if s.url not in models]
        raise EngineTimeoutError(
            f"only {len(ready)} of {len(fleet._servers)} inference servers answered /health "
            f"within {fleet.start_timeout}s (min_servers {need}); missing: {missing}"
        )
    if not fleet.check_models:
        return ready
    first_url = ready[0].url
    if fleet.model == "default" and models[first_url]:
        # ask for what the servers serve (vLLM refuses a request naming another model)
        fleet.model = models[first_url][0]
        for server in fleet._servers:
            server.engine.model = fleet.model
    for url, served in models.items():
        if served != models[first_url]:
            raise EngineConfigError(
                f"inference servers disagree on the model: {first_url} serves "
                f"{models[first_url]}, {url} serves {served}"
            )
    if fleet.model != "default" and fleet.model not in models[first_url]:
        raise EngineConfigError(
            f"inference servers serve {models[first_url]}, not the model {fleet.model!r}"
        )
    fleet._models = models[first_url]
    for server in ready:
        server.checked = True
    return ready


@asynccontextmanager
async def open_engine_fleet(urls: str | Sequence[str], **kwargs: Any) -> AsyncIterator[EngineFleet]:
    """Open an :class:`EngineFleet` over the servers at ``urls`` (keyword arguments as in its
    constructor): wait for every server (or ``min_servers`` of them; the others start taken
    out) to answer ``/health`` (``start_timeout``; an :class:`EngineTimeoutError` names the
    missing ones), check that they serve the
    same models (:class:`EngineConfigError` naming both), then probe them while the block runs.
    Leaving the block stops the probes and closes every client; requests still running get
    ``trio.ClosedResourceError`` or are cancelled with it."""
    fleet = EngineFleet(urls, **kwargs)
    with collapse_single():
        async with _opened(fleet) as opened:
            yield opened


@asynccontextmanager
async def _opened(fleet: EngineFleet) -> AsyncIterator[EngineFleet]:
    from ._vllm import VLLMAdmin

    async with AsyncExitStack() as stack:
        for url in fleet.urls:
            engine = OpenAICompatibleEngine(
                (url,),
                model=fleet.model,
                # the fleet's own deadline is the one that fires; retries are the fleet's
                timeout=fleet.timeout + 1.0,
                max_attempts=1,
                stream=fleet.stream,
                abort_path=fleet.abort_path,
                extra_body=fleet.extra_body,
                headers=fleet.headers,
                routing_header=fleet.routing_header,
                version_field=None,
                version_header=None,
            )
            admin = VLLMAdmin(url, timeout=fleet.admin_timeout, headers=fleet.headers)
            await stack.enter_async_context(engine)
            await stack.enter_async_context(admin)
            fleet._servers.append(_Server(url, engine, admin))
        ready = await _check_servers(fleet)
        for server in fleet._servers:
            if server not in ready:
                # like a server taken out: the probes bring it in once it answers
                server.state = "out"
                reason = "it did not answer at opening"
                fleet._events.append(
                    FleetEvent(trio.current_time(), server.url, "out", None, reason)
                )
                logger.warning("inference server %s starts taken out: %s", server.url, reason)
        fleet._live.value = frozenset(s.url for s in ready)
        nursery = await stack.enter_async_context(trio.open_nursery())
        for server in fleet._servers:
            nursery.start_soon(_watch, fleet, server)
        fleet._open = True
        try:
            yield fleet
        finally:
            fleet._open = False
            nursery.cancel_scope.cancel()
