"""Inference engines: the ``Engine`` protocol and its implementations."""

from ._distributions import DISTRIBUTIONS as DISTRIBUTIONS
from ._distributions import CorrelatedTokens as CorrelatedTokens
from ._distributions import Draw as Draw
from ._distributions import LatencyDistribution as LatencyDistribution
from ._distributions import LogNormalSeconds as LogNormalSeconds
from ._distributions import LogNormalTokens as LogNormalTokens
from ._distributions import ParetoSeconds as ParetoSeconds
from ._distributions import get_distribution as get_distribution
from ._errors import EngineClosedError as EngineClosedError
from ._errors import EngineConfigError as EngineConfigError
from ._errors import EngineError as EngineError
from ._errors import EngineRequestError as EngineRequestError
from ._errors import EngineResponseError as EngineResponseError
from ._errors import EngineTimeoutError as EngineTimeoutError
from ._errors import EngineTransportError as EngineTransportError
from ._errors import SimulatedEngineFailure as SimulatedEngineFailure
from ._openai import OpenAICompatibleEngine as OpenAICompatibleEngine
from ._openai import parse_completion_response as parse_completion_response
from ._protocol import Completion as Completion
from ._protocol import Engine as Engine
from ._protocol import FinishReason as FinishReason
from ._protocol import GenerateRequest as GenerateRequest
from ._protocol import SamplingParams as SamplingParams
from ._simulated import EngineStatistics as EngineStatistics
from ._simulated import SimulatedEngine as SimulatedEngine
from ._torch import TorchEngine as TorchEngine
