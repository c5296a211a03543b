"""Inference engines: the ``Engine`` protocol and its implementations."""

from ._protocol import Completion as Completion
from ._protocol import Engine as Engine
from ._protocol import FinishReason as FinishReason
from ._protocol import GenerateRequest as GenerateRequest
from ._protocol import SamplingParams as SamplingParams
