"""delft's GRPO trainer for library use: TRL's ``GRPOTrainer`` plus the auxiliary digit term on the gold solutions
(delft.training.grpo_trainer, where it lives because ``delft train``'s GRPO stage runs it), and the numeric rewards
as TRL reward functions (delft.numbers.rewards).

    from delft.integrations.grpo import DigitGRPOTrainer, exact_reward, digit_reward
"""

from delft.numbers.rewards import digit_reward, exact_reward
from delft.training.grpo_trainer import DigitGRPOTrainer, mu_at

__all__ = ["DigitGRPOTrainer", "digit_reward", "exact_reward", "mu_at"]
