"""The train layer: scoring, the train sink, by-handle payloads, checkpoint and resume."""

from ._types import TrainingSample as TrainingSample
