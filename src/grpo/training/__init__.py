"""The training loop: one GRPO step after another (trainer), the policy update and its
log-probabilities, the generation batch, the train state, the reference policy and
critic, metrics and held-out evaluation."""
