"""`ToolEnv`: the policy calls tools until it answers; pluggable call syntaxes.

A turn whose text holds no tool call is the answer, scored by the reward function. A turn with
calls runs them one after the other, each under a deadline of ``tool_timeout`` (async tools
awaited on the loop, plain ones in worker threads under the run's limiter), shows each result
to the policy and asks for the next turn. A tool that times out ends the episode as
``tool_timeout`` (also one that catches its cancellation and returns), one that raises as
``error``: the episode is lost, never the run. A call that does not parse (bad JSON, an unknown
tool, arguments the tool does not take) is shown to the policy as an error message and costs a
turn.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import trio

from .._validation import optional_positive_finite, optional_positive_int
from ..errors import EnvConfigError, ToolCallSyntaxError
from ._episode import Episode

__all__ = ["CallSyntax", "CompactCalls", "HermesCalls", "ToolCall", "ToolEnv", "ToolRewardFn"]

#: ``fn(record, answer, calls) -> float``, plain or async: the episode's reward from its record,
#: the text of its last turn (the one without a call) and the calls it made, in order.
ToolRewardFn = Callable[[Mapping[str, Any], str, Sequence["ToolCall"]], float | Awaitable[float]]


@attrs.frozen
class ToolCall:
    """One call the policy asked for: the tool's name, positional and keyword arguments."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)


class CallSyntax(Protocol):
    """How tool calls are written in the policy's text and how results are shown to it."""

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in ``text`` (none: the text is the answer); raises
        :class:`~trio_rl.errors.ToolCallSyntaxError` for a call that does not parse."""
        ...

    def show(self, episode: Episode, call: ToolCall, result: str) -> None:
        """Append a call's result to ``episode``."""
        ...

    def show_error(self, episode: Episode, message: str) -> None:
        """Append the message of a call that could not run (it did not parse, names no tool,
        or has arguments the tool does not take) to ``episode``."""
        ...


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@attrs.frozen
class HermesCalls:
    """Hermes-style calls for chat models: ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>``, any number per turn. Results go back as ``tool`` messages through the chat
    template (:meth:`Episode.observe_message`), or without one as
    ``<tool_response>...</tool_response>`` text."""

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in _HERMES.findall(text):
            try:
                value = json.loads(body)
            except json.JSONDecodeError as exc:
                raise ToolCallSyntaxError(f"the tool call is not valid JSON: {exc.msg}") from None
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                raise ToolCallSyntaxError('a tool call is a JSON object with a "name" string')
            arguments = value.get("arguments", {})
            if not isinstance(arguments, dict):
                raise ToolCallSyntaxError('a tool call\'s "arguments" must be a JSON object')
            calls.append(ToolCall(value["name"], (), arguments))
        return calls

    def show(self, episode: Episode, call: ToolCall, result: str) -> None:
        if episode.chat is not None:
            episode.observe_message("tool", result)
        else:
            episode.observe(f"<tool_response>\n{result}\n</tool_response>\n")

    def show_error(self, episode: Episode, message: str) -> None:
        self.show(episode, ToolCall("error"), f"error: {message}")


@attrs.frozen
class CompactCalls:
    """A call syntax for tiny character models: a turn whose text starts with a match of
    ``pattern`` (a regular expression) calls the tool ``tool`` (default: the environment's only
    tool) with the pattern's groups as arguments; the rest of the turn is ignored. The default,
    ``?`` then anything, passes the rest of the text as the one argument. A result is shown as
    its text followed by ``end``, a call that cannot run as ``error`` followed by ``end`` (a
    character model's vocabulary has no room for messages)."""

    pattern: str = r"\?(.*)"
    tool: str | None = None
    end: str = "="
    error: str = ""
    _compiled: re.Pattern[str] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        try:
            compiled = re.compile(self.pattern, re.DOTALL)
        except re.error as exc:
            raise EnvConfigError(f"CompactCalls.pattern {self.pattern!r}: {exc}") from None
        object.__setattr__(self, "_compiled", compiled)

    def parse(self, text: str) -> list[ToolCall]:
        match = self._compiled.match(text)
        if match is None:
            return []
        return [ToolCall(self.tool or "", match.groups())]

    def show(self, episode: Episode, call: ToolCall, result: str) -> None:
        episode.observe(result + self.end)

    def show_error(self, episode: Episode, message: str) -> None:
        episode.observe(self.error + self.end)


def _late(call: ToolCall, timeout: float) -> str:
    return f"tool {call.name!r} took over {timeout:g} s"


def _tool_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise EnvConfigError(f"ToolEnv: tool {fn!r} has no __name__; wrap it in a function")
    return name


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


_SHAPES = 64  # call shapes remembered per tool


@attrs.define(slots=True, eq=False)
class _Tool:
    """A tool with what every call of it needs, worked out once: whether it is async, and its
    signature (found at the first call) to check a call's arguments against."""

    fn: Callable[..., Any]
    is_async: bool
    _checked: bool = False
    _signature: inspect.Signature | None = None
    _unusable: str | None = None  # why the tool has no signature to bind to
    # whether a call fits depends only on its number of positional arguments and its keyword
    # names, in order: Signature.bind once per such shape, not per call (~3.5 us a call);
    # bounded, as the shapes are the policy's to make up
    _fits: dict[tuple[int, tuple[str, ...]], str | None] = attrs.field(factory=dict)

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> _Tool:
        return cls(fn, _is_async(fn))

    def misfit(self, call: ToolCall) -> str | None:
        """Why ``call``'s arguments do not fit the tool (None: they do, or it cannot say)."""
        if not self._checked:
            # inspect.signature on every call was ~10 % of an episode's CPU in bench_episodes
            try:
                self._signature = inspect.signature(self.fn)
            except TypeError as exc:
                self._unusable = str(exc)
            except ValueError:
                pass  # no signature to check (a builtin): the call itself will say
            self._checked = True
        if self._unusable is not None:
            return self._unusable
        if self._signature is None:
            return None
        shape = (len(call.args), tuple(call.kwargs))
        try:
            return self._fits[shape]
        except KeyError:
            pass
        misfit = None
        try:
            self._signature.bind(*call.args, **call.kwargs)
        except TypeError as exc:
            misfit = str(exc)
        if len(self._fits) < _SHAPES:
            self._fits[shape] = misfit
        return misfit


def _named(tools: Sequence[Callable[..., Any]]) -> dict[str, _Tool]:
    return {_tool_name(fn): _Tool.of(fn) for fn in tools}


def _with_blank(named: dict[str, _Tool]) -> dict[str, _Tool]:
    if len(named) == 1:
        named[""] = next(iter(named.values()))  # the one tool of a syntax that names none
    return named


@attrs.frozen
class ToolEnv:
    """An environment (``await env(episode, record) -> reward``) where the policy may call
    ``tools`` before it answers.

    ``tools`` are plain or async callables, named by ``__name__`` (read once, when the
    environment is made); ``record_tools(record)``
    adds tools made for each record (a tool that reads the record). ``reward(record, answer,
    calls)`` scores the last turn's text. ``max_turns`` bounds the policy turns (a turn past it
    ends the episode as ``max_turns``; unset: the run's ``[env] max_turns``); ``tool_timeout``
    bounds each call (expiry: ``tool_timeout``; unset: the run's ``[env] tool_timeout``);
    ``syntax`` says how calls are written (:class:`HermesCalls` by default,
    :class:`CompactCalls` for the built-in character model).
    """

    tools: Sequence[Callable[..., Any]]
    reward: ToolRewardFn
    max_turns: int | None = attrs.field(default=None, validator=optional_positive_int)
    tool_timeout: float | None = attrs.field(default=None, validator=optional_positive_finite)
    syntax: CallSyntax = attrs.field(factory=HermesCalls)
    record_tools: Callable[[Mapping[str, Any]], Sequence[Callable[..., Any]]] | None = None

    # the tools, the reward's kind and the box of an environment without record tools are
    # worked out once here rather than for every episode (or call)
    _named: dict[str, _Tool] | None = attrs.field(init=False, repr=False, eq=False)
    _box: dict[str, _Tool] | None = attrs.field(init=False, repr=False, eq=False)
    _async_reward: bool = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        try:
            named: dict[str, _Tool] | None = _named(self.tools)
        except EnvConfigError:
            named = None  # a tool without a name fails each episode, as the environment's error
        box = None if named is None or self.record_tools is not None else _with_blank(dict(named))
        object.__setattr__(self, "_named", named)
        object.__setattr__(self, "_box", box)
        object.__setattr__(self, "_async_reward", _is_async(self.reward))

    def _toolbox(self, record: Mapping[str, Any]) -> dict[str, _Tool]:
        if self._box is not None:
            return self._box
        named = dict(self._named) if self._named is not None else _named(self.tools)
        if self.record_tools is not None:
            named.update(_named(self.record_tools(record)))
        return _with_blank(named)

    async def __call__(self, episode: Episode, record: Mapping[str, Any]) -> float:
        box = self._toolbox(record)
        made: list[ToolCall] = []
        # bounded: every pass is a policy turn, which max_turns (this env's or the run's) and
        # the episode's token budget end; episode_timeout bounds it in time
        while True:
            if self.max_turns is not None and episode.turns >= self.max_turns:
                episode.stop("max_turns")
            text = await episode.generate()
            try:
                calls = self.syntax.parse(text)
            except ToolCallSyntaxError as exc:
                self.syntax.show_error(episode, str(exc))
                continue
            if not calls:
                return await self._score(episode, record, text, made)
            for call in calls:
                made.append(call)
                await self._run(episode, box, call)

    async def _score(
        self, episode: Episode, record: Mapping[str, Any], text: str, made: list[ToolCall]
    ) -> float:
        if self._async_reward:
            return float(await self.reward(record, text, made))  # type: ignore[misc]
        value: Any = await episode.run_sync(self.reward, record, text, made)
        return float(value)

    async def _run(self, episode: Episode, box: Mapping[str, _Tool], call: ToolCall) -> None:
        """Run ``call`` and show its result (or why it could not run) to the policy."""
        tool = box.get(call.name)
        if tool is None:
            known = ", ".join(sorted(n for n in box if n))
            self.syntax.show_error(episode, f"unknown tool {call.name!r} (tools: {known})")
            return
        misfit = tool.misfit(call)
        if misfit is not None:
            self.syntax.show_error(episode, f"{call.name}: {misfit}")
            return
        episode.stats.tool_calls += 1
        timeout = episode.config.tool_timeout if self.tool_timeout is None else self.tool_timeout
        fn = tool.fn
        try:
            # a bare cancel scope, not trio.fail_after (a generator context manager): ~3 % of
            # an episode's CPU in bench_episodes; expiry is read from the scope below
            with episode.cancel_after(timeout) as scope:
                if tool.is_async:
                    result = await fn(*call.args, **call.kwargs)
                else:
                    result = await episode.run_sync(fn, *call.args, **call.kwargs)
        except trio.TooSlowError:  # the tool's own deadline: a timeout all the same
            episode.stop("tool_timeout", detail=_late(call, timeout))
        except Exception as exc:
            if scope.cancel_called:  # it raised something else once cancelled
                episode.stop("tool_timeout", detail=_late(call, timeout))
            episode.stop("error", detail=f"tool {call.name!r} raised {type(exc).__name__}: {exc}")
        if scope.cancel_called:
            # cancelled at its deadline, even if the tool caught the cancellation and returned:
            # the episode ends, its result unseen
            episode.stop("tool_timeout", detail=_late(call, timeout))
        self.syntax.show(episode, call, str(result))
