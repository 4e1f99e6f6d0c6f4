"""The run's configuration: the root `Config` and `validate` (schema), its sections, each with
its own checks (model_data, rollout_rewards, algorithm, training; the shared value checks in
checks), the papers' presets (presets), reading and writing a config (loading), the bounded YAML
reader (safe_yaml), the one error of a bad value (errors) and the generated reference of every
key (docs)."""
