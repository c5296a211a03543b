"""trainer layer."""

from ._config import TrainerConfig as TrainerConfig
from ._payloads import payload_files as payload_files
from ._payloads import read_payload_arrays as read_payload_arrays
from ._payloads import release_payload_files as release_payload_files
from ._receiver import BatchReceiver as BatchReceiver
from ._tensors import TensorConversionError as TensorConversionError
from ._tensors import TrainerTensors as TrainerTensors
from ._tensors import to_torch as to_torch
