"""Evaluation: held-out pass@k of one policy version, during training and after it.

* :func:`pass_at_k` (the unbiased Codex estimator), :func:`pass_hat_k` (pass^k) and their
  means over prompts;
* :class:`EvalRunner`: ``k`` samples per held-out prompt, through a
  :class:`~trio_rl.rollout.PriorityLane` that shares the training driver's credits and goes
  first, cut at a deadline, reduced to an :class:`EvalResult`;
* :class:`VersionPin`: no weights are loaded into the engines while an eval runs, so all its
  samples come from one policy version;
* :class:`EvalJournal`: ``eval.jsonl`` and the marker that lets a resumed run redo or drop an
  eval a kill cut short, with nothing logged twice;
* :class:`RunEvals`: the evals of a training run, driven by its weight loader: which version
  to load next so no due eval is skipped, each eval under the pin, recorded once;
* :class:`EvalConfig`: the ``[eval]`` knobs.

See docs/evaluation.md.
"""

from ..errors import EvalConfigError as EvalConfigError
from ..errors import EvalError as EvalError
from ..rundir import EVAL_LOG as EVAL_LOG
from ..rundir import EVAL_PENDING_FILE as EVAL_PENDING_FILE
from ._config import BUILTIN_HELD_OUT as BUILTIN_HELD_OUT
from ._config import EvalConfig as EvalConfig
from ._config import OnResume as OnResume
from ._estimators import PromptOutcome as PromptOutcome
from ._estimators import mean_pass_at_k as mean_pass_at_k
from ._estimators import mean_pass_hat_k as mean_pass_hat_k
from ._estimators import pass_at_k as pass_at_k
from ._estimators import pass_hat_k as pass_hat_k
from ._journal import EvalJournal as EvalJournal
from ._journal import PendingEval as PendingEval
from ._pin import VersionPin as VersionPin
from ._result import EVAL_STATUSES as EVAL_STATUSES
from ._result import EvalResult as EvalResult
from ._result import EvalStatus as EvalStatus
from ._runner import EvalProgress as EvalProgress
from ._runner import EvalRunner as EvalRunner
from ._runner import turns_of as turns_of
from ._session import EvalReport as EvalReport
from ._session import RunEvals as RunEvals
