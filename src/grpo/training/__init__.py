"""The training loop: the run's parts built from a config (build), one GRPO step over them
(step: collect, scoring, sampling, update, critic), the loop around it (trainer), and what
they share: the generation batch, the train state, the reference policy, metrics, checkpoints
and held-out evaluation."""
