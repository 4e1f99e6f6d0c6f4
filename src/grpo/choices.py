"""Names of the algorithm's options, shared by the math and the config check
(kept free of torch so that a bad config fails in a fraction of a second)."""

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_LEVELS = ("token", "sequence")
LR_SCHEDULES = ("constant", "linear", "cosine")
