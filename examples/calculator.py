"""A calculator behind Hermes-style tool calls, for chat models (examples/vllm_tool.toml).

The policy may call ``calc`` with an arithmetic expression,
``<tool_call>{"name": "calc", "arguments": {"x": "6*7"}}</tool_call>``; the result comes back as
a ``tool`` message through the model's chat template. A turn without a call is the answer,
scored 1.0 when it is the record's ``answer``.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trio_rl.envs import HermesCalls, ToolCall, ToolEnv

_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


def calc(x: str) -> str:
    """``+ - *`` over integers; anything else raises (and ends the episode as ``error``)."""

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](value(node.left), value(node.right)))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    return str(value(ast.parse(x, mode="eval").body))


def reward(record: Mapping[str, Any], answer: str, calls: Sequence[ToolCall]) -> float:
    return float(answer.strip() == str(record["answer"]))


#: ``[env] function = "examples.calculator:calculator"``
calculator = ToolEnv([calc], reward, max_turns=3, syntax=HermesCalls())
