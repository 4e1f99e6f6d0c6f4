"""TRL's GRPOConfig (trl.config) and GRPOTrainer (trl.trainer) over grpo's parts, exported
lazily as `grpo.GRPOConfig` and `grpo.GRPOTrainer`; TRL's arguments are turned into grpo's by
trl.rows (datasets), trl.rewards (reward functions and models), trl.lora (peft), trl.arguments
(tools, the processing class, the refusals) and trl.generation (TRL's `_generate` output)."""
