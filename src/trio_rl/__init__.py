"""trio-rl: rollout orchestration for asynchronous RL on language models, on trio.

The public facade: re-exports the API; defines nothing.
"""

from .samples import Group as Group
from .samples import PolicyVersion as PolicyVersion
from .samples import Prompt as Prompt
from .samples import ResumedGroup as ResumedGroup
from .samples import Sample as Sample
from .samples import SampleStatus as SampleStatus
from .samples import new_group_id as new_group_id

__version__ = "0.1.0"
