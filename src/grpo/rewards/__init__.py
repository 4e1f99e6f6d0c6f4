"""Rewards: the built-in functions, the set a run scores with (reward_set), and the
worker processes that keep a user's reward function apart from the trainer."""
