"""trainer layer."""

from ._receiver import BatchReceiver as BatchReceiver
from ._tensors import TensorConversionError as TensorConversionError
from ._tensors import TrainerTensors as TrainerTensors
from ._tensors import to_torch as to_torch
