"""`TrainerConfig`: the optimisation of one step of the reference GRPO trainer
(:class:`trio_rl.learn.GRPOTrainer`).

It lives here, torch-free, rather than beside the trainer in :mod:`trio_rl.learn`: the
configuration files' ``[trainer]`` section is generated from its fields (``trio_rl.config``),
and the configuration must load without torch.
"""

from __future__ import annotations

import attrs

from .._validation import at_least, optional_positive_finite, positive_finite


@attrs.frozen
class TrainerConfig:
    """The optimisation of one step.

    Each step runs ``epochs`` AdamW updates over the whole batch (PPO-style reuse); the
    importance ratio against the inference logprobs is clipped to ``[1 - clip, 1 + clip]``.
    ``entropy_coef`` adds ``-entropy_coef x`` the mean token entropy (of the distributions the
    trained tokens were sampled from) to the loss: an entropy bonus that keeps the policy from
    collapsing onto one reply per prompt while it is still wrong (docs/learning.md).

    Each knob's meaning is its field's ``metadata["help"]``: the ``[trainer]`` section of
    ``trio-rl run``'s configuration is generated from these fields (``betas`` aside, no key).
    """

    lr: float = attrs.field(
        default=1e-3, validator=positive_finite, metadata={"help": "AdamW learning rate"}
    )
    weight_decay: float = attrs.field(
        default=0.0, validator=at_least(0), metadata={"help": "AdamW weight decay"}
    )
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.99), metadata={"help": "AdamW's betas"}
    )
    clip: float = attrs.field(
        default=0.2, validator=positive_finite, metadata={"help": "importance-ratio clip"}
    )
    epochs: int = attrs.field(
        default=4, validator=at_least(1), metadata={"help": "AdamW updates per batch"}
    )
    max_grad_norm: float | None = attrs.field(
        default=1.0,
        validator=optional_positive_finite,
        metadata={"help": "gradient-norm clip (unset: none)"},
    )
    entropy_coef: float = attrs.field(
        default=0.01,
        validator=at_least(0),
        metadata={"help": "entropy bonus: minus this times the mean token entropy joins the loss"},
    )
