"""What the tests' generation servers share (grpo serve): their secret and the model they
serve. A module of its own, not conftest.py, so that test modules can import it by a name no
other conftest.py shadows."""

SERVE_KEY = "a-test-secret"
"""The shared secret of the tests' generation servers (GRPO_SERVE_API_KEY)."""

SERVED_TINY = {
    "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
    "data": {
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 4], [1, 4]],
            "operators": ["+"],
            "instruction": "{expression}=",
            "num_train": 200,
            "num_eval": 4,
        },
    },
    "rollout": {"num_generations": 4, "max_completion_length": 3, "temperature": 0.9},
    "rewards": {"isolation": "thread"},
}
"""The config a served run and its server share (the tests add rewards, steps and output_dir)."""
