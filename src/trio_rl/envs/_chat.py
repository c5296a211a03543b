"""Chat templates, one message at a time: the tokens of a new message without re-tokenizing
the conversation before it, and the check that a template did not rewrite earlier turns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..errors import EnvConfigError, TemplateMismatchError

__all__ = ["ChatTemplate", "Message"]

#: One chat message: ``{"role": ..., "content": ...}``.
Message = Mapping[str, Any]

# What a message is rendered after, to learn what the template puts around it. The content
# is never tokenized: only the text the template adds around it is.
_SENTINEL = "\u2063trio-rl\u2063"
_BASE: tuple[Message, ...] = (
    {"role": "user", "content": _SENTINEL},
    {"role": "assistant", "content": _SENTINEL},
)


@attrs.define(slots=True, eq=False)
class ChatTemplate:
    """A Hugging Face tokenizer's chat template, rendered one message at a time.

    ``tokenizer`` is any object with the three methods of a ``transformers`` tokenizer the
    template needs: ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=...)``, ``encode(text, add_special_tokens=False)`` and
    ``decode(ids, skip_special_tokens=...)``. ``end_of_turn`` is the token that ends an
    assistant turn (the one the engine stops at; the tokenizer's ``eos_token_id`` by default).

    A message's tokens are the text the template adds for it, rendered after a fixed
    two-message conversation and encoded alone; the earlier turns are never re-tokenized.
    What the template puts after an assistant's end of turn (a newline, say) is appended before
    the next message, so the boundary tokens are the template's.
    """

    tokenizer: Any
    end_of_turn: int | None = None
    #: the template's text after an assistant message's content (its end of turn first)
    closing_text: str = attrs.field(init=False, default="")
    _closing: tuple[int, ...] = attrs.field(init=False, default=())
    _generation_prompt: tuple[int, ...] = attrs.field(init=False, default=())

    def __attrs_post_init__(self) -> None:
        if self.end_of_turn is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if not isinstance(eos, int):
                raise EnvConfigError(
                    "ChatTemplate.end_of_turn: the tokenizer names no eos_token_id; pass the "
                    "token that ends an assistant turn"
                )
            self.end_of_turn = eos
        base = self.render(_BASE)
        self.closing_text = base[base.rindex(_SENTINEL) + len(_SENTINEL) :]
        self._closing = self.encode(self.closing_text)
        asked = [*_BASE, {"role": "user", "content": _SENTINEL}]
        self._generation_prompt = self.encode(
            self._after(self.render(asked), self.render(asked, add_generation_prompt=True))
        )

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The template's text of ``messages``."""
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(text, str):
            raise EnvConfigError(
                f"ChatTemplate: apply_chat_template(tokenize=False) returned "
                f"{type(text).__name__}, not text"
            )
        return text

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """``tokens`` as text; ``special``: the special tokens written out (as the template
        writes them)."""
        text: str = self.tokenizer.decode(list(tokens), skip_special_tokens=not special)
        return text

    @staticmethod
    def _after(before: str, after: str) -> str:
        if not after.startswith(before):
            raise EnvConfigError(
                "ChatTemplate: the template is not append-only: adding a message changed the "
                "text of the messages before it"
            )
        return after[len(before) :]

    def message(self, role: str, content: str) -> tuple[int, ...]:
        """The tokens of one new message (no generation prompt), rendered after a user and an
        assistant message, or after a user message alone for a template that renders an
        assistant message differently once another follows it (the episode's check reports
        such a template when it changed the episode's own turns). Raises
        :class:`~trio_rl.errors.TemplateMismatchError` when neither renders it by appending."""
        new = {"role": role, "content": content}
        for base in (_BASE, _BASE[:1]):
            before, after = self.render(base), self.render([*base, new])
            if after.startswith(before):
                return self.encode(after[len(before) :])
        raise TemplateMismatchError(
            f"ChatTemplate: a {role!r} message cannot be rendered alone: the template changes "
            "the text of the messages before it"
        )

    @property
    def generation_prompt(self) -> tuple[int, ...]:
        """The tokens that open an assistant turn (``add_generation_prompt``)."""
        return self._generation_prompt

    def closing(self, sampled: Sequence[int]) -> tuple[int, ...]:
        """The tokens that close an assistant turn whose sampled tokens were ``sampled``: the
        template's closing after the end of turn when the policy sampled it, else all of it (a
        turn cut by its token cap)."""
        closing = self._closing
        if sampled and closing and sampled[-1] == self.end_of_turn and closing[0] == sampled[-1]:
            return closing[1:]
        return closing

    def matches(self, messages: Sequence[Message], tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` (an episode's, the prompt included) are what the template makes of
        ``messages``: their text is the template's text of the conversation, up to the
        closing of the last assistant turn. Compared as text, so a policy's own tokenization
        of its text is not a mismatch; a template that drops or rewrites earlier turns is."""
        held = self.decode(tokens, special=True)
        rendered = self.render(messages)
        if not rendered.startswith(held):
            return False
        return self.closing_text.endswith(rendered[len(held) :])
