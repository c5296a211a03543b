"""Engines and codecs the environment tests drive episodes with."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import trio

from trio_rl.engines import Completion, Engine, FinishReason, GenerateRequest

CHARS = "abcdefgh12345?="
EOS = 1


@attrs.frozen
class CharCodec:
    """Characters <-> ids 2.. (0 pad, 1 eos); decode stops at eos."""

    chars: str = CHARS

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(2 + self.chars.index(c) for c in text)

    def decode(self, tokens: Sequence[int]) -> str:
        out = []
        for t in tokens:
            if t == EOS:
                break
            out.append(self.chars[t - 2])
        return "".join(out)


CODEC = CharCodec()


@attrs.define(eq=False)
class ScriptedPolicy:
    """An engine whose reply to a prompt is ``reply(prompt text)`` then eos (cut at
    ``max_tokens``), each token with logprob ``-0.01 * (position + 1)``, stamped ``version``."""

    reply: Callable[[str], str]
    version: int = 0
    delay: float = 0.0

    async def generate(self, request: GenerateRequest) -> Completion:
        await trio.sleep(self.delay)
        text = self.reply(CODEC.decode([t for t in request.prompt_tokens if t != EOS]))
        tokens = [*CODEC.encode(text), EOS][: request.params.max_tokens]
        finish: FinishReason = "stop" if tokens and tokens[-1] == EOS else "length"
        logprobs = [-0.01 * (i + 1) for i in range(len(tokens))]
        return Completion(tokens, logprobs, finish, self.version)


@attrs.define(eq=False)
class RecordingEngine:
    """Wraps an engine; keeps every request it passed on."""

    inner: Engine
    requests: list[GenerateRequest] = attrs.field(factory=list)

    async def generate(self, request: GenerateRequest) -> Completion:
        self.requests.append(request)
        return await self.inner.generate(request)
