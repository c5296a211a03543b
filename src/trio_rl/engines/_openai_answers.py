"""What an OpenAI-compatible server's answers mean: a ``/v1/completions`` body or stream chunk
(tokens, logprobs, finish reason) and the policy version a server reports in a field or a
header. Every malformed answer is an :class:`~trio_rl.engines.EngineResponseError` naming
where it came from."""

from __future__ import annotations

import httpx

from .._validation import is_number
from ..samples import PolicyVersion
from ._errors import EngineResponseError
from ._protocol import FinishReason

__all__ = ["parse_completion_chunk", "parse_completion_response"]

_FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})
_TOKEN_PREFIX = "token_id:"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_completion_response(
    data: object, *, where: str = "response"
) -> tuple[list[int], list[float], FinishReason]:
    """Tokens, logprobs and finish reason of the first choice of a ``/v1/completions`` body.

    Accepted token forms, in this order:

    - ``choices[0].token_ids``: a list of ints (vLLM with ``return_token_ids``);
    - ``choices[0].logprobs.tokens``: strings ``"token_id:<int>"`` (vLLM and SGLang with
      ``return_tokens_as_token_ids``).

    Logprobs come from ``choices[0].logprobs.token_logprobs`` (numbers, one per token). The
    finish reason must be ``stop``, ``length`` or ``abort``. Anything else raises
    :class:`EngineResponseError` naming the field and ``where`` (server and request id).
    """
    if not isinstance(data, dict):
        raise EngineResponseError(f"{where}: body is {type(data).__name__}, not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise EngineResponseError(f"{where}: field 'choices' is missing or not a non-empty list")
    tokens, logprobs, finish = _parse_choice(choices[0], where, chunk=False)
    assert finish is not None  # _parse_choice requires one outside a stream
    return tokens, logprobs, finish


def parse_completion_chunk(
    data: object, *, where: str = "chunk"
) -> tuple[list[int], list[float], FinishReason | None]:
    """Tokens, logprobs and finish reason of one server-sent event of a streamed
    ``/v1/completions`` answer (``"stream": true``), as vLLM and SGLang send them.

    The tokens and logprobs are the ones this chunk adds, in the forms
    :func:`parse_completion_response` accepts; the finish reason is None until the last chunk.
    A chunk with an empty ``choices`` list (the usage chunk) adds nothing, and so does a choice
    without ``logprobs`` that carries no text and no token ids. An error object sent in the
    stream (``{"error": ...}`` or ``"object": "error"``) and anything malformed raise
    :class:`EngineResponseError` naming the field and ``where``.
    """
    if not isinstance(data, dict):
        raise EngineResponseError(f"{where}: chunk is {type(data).__name__}, not a JSON object")
    if "error" in data or data.get("object") == "error":
        detail = data.get("error", data.get("message"))
        raise EngineResponseError(f"{where}: the server sent an error in the stream: {detail!r}")
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise EngineResponseError(f"{where}: field 'choices' is missing or not a list")
    if not choices:
        return [], [], None
    return _parse_choice(choices[0], where, chunk=True)


def _parse_choice(
    choice: object, where: str, *, chunk: bool
) -> tuple[list[int], list[float], FinishReason | None]:
    if not isinstance(choice, dict):
        raise EngineResponseError(f"{where}: field 'choices[0]' is not an object")
    finish = choice.get("finish_reason")
    if not (finish in _FINISH_REASONS or (chunk and finish is None)):
        raise EngineResponseError(
            f"{where}: field 'choices[0].finish_reason' = {finish!r} is not one of "
            "'stop', 'length', 'abort'"
        )
    reason: FinishReason | None = finish
    lp = choice.get("logprobs")
    if chunk and lp is None and not choice.get("text") and not choice.get("token_ids"):
        return [], [], reason  # a chunk that adds no token (e.g. only the finish reason)
    if not isinstance(lp, dict):
        raise EngineResponseError(
            f"{where}: field 'choices[0].logprobs' is missing (the engine must return logprobs)"
        )

    tokens: list[int]
    token_ids = choice.get("token_ids")
    if token_ids is not None:
        if not isinstance(token_ids, list):
            raise EngineResponseError(f"{where}: field 'choices[0].token_ids' is not a list")
        for i, t in enumerate(token_ids):
            if not _is_int(t):
                raise EngineResponseError(
                    f"{where}: field 'choices[0].token_ids[{i}]' = {t!r} is not an int"
                )
        tokens = list(token_ids)
    else:
        strings = lp.get("tokens")
        if not isinstance(strings, list):
            raise EngineResponseError(
                f"{where}: neither 'choices[0].token_ids' nor 'choices[0].logprobs.tokens' "
                "holds token ids (request them with return_tokens_as_token_ids)"
            )
        tokens = []
        for i, s in enumerate(strings):
            if not (isinstance(s, str) and s.startswith(_TOKEN_PREFIX)):
                raise EngineResponseError(
                    f"{where}: field 'choices[0].logprobs.tokens[{i}]' = {s!r} is not of the "
                    "form 'token_id:<int>'"
                )
            try:
                tokens.append(int(s[len(_TOKEN_PREFIX) :]))
            except ValueError:
                raise EngineResponseError(
                    f"{where}: field 'choices[0].logprobs.tokens[{i}]' = {s!r} is not of the "
                    "form 'token_id:<int>'"
                ) from None

    raw_logprobs = lp.get("token_logprobs")
    if not isinstance(raw_logprobs, list):
        raise EngineResponseError(
            f"{where}: field 'choices[0].logprobs.token_logprobs' is missing or not a list"
        )
    for i, v in enumerate(raw_logprobs):
        if not is_number(v):
            raise EngineResponseError(
                f"{where}: field 'choices[0].logprobs.token_logprobs[{i}]' = {v!r} is not a number"
            )
    logprobs = [float(v) for v in raw_logprobs]
    if len(logprobs) != len(tokens):
        raise EngineResponseError(
            f"{where}: {len(tokens)} tokens but {len(logprobs)} logprobs in 'choices[0]'"
        )
    return tokens, logprobs, reason


def _json_version(data: object, field: str | None, where: str) -> PolicyVersion | None:
    """The integer ``field`` of a JSON answer (None: not configured, or absent)."""
    if field is None or not isinstance(data, dict) or field not in data:
        return None
    value = data[field]
    if not _is_int(value):
        raise EngineResponseError(f"{where}: field {field!r} = {value!r} is not an int")
    return int(value)


def _header_version(headers: httpx.Headers, name: str | None, where: str) -> PolicyVersion | None:
    """The integer header ``name`` of an answer (None: not configured, or absent)."""
    if name is None or name not in headers:
        return None
    text = headers[name]
    try:
        return int(text)
    except ValueError:
        raise EngineResponseError(f"{where}: header {name!r} = {text!r} is not an int") from None
