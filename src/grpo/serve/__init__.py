"""`grpo serve`: a generation server that trainers send prompts to and stream weights to.

    GRPO_SERVE_API_KEY=secret grpo serve examples/tiny.yaml --engine hf --port 8000

`--engine hf` (grpo.serve.hf) serves grpo's own `hf` engine, built as a trainer builds it for the
same model config (its device layer and decoding included), behind the endpoints of vLLM's
OpenAI-compatible server and its weight-transfer routes, so that the `server` rollout engine
(grpo.rollout.server) speaks to it as to vLLM. It binds to 127.0.0.1 unless told otherwise, and
every endpoint but /health and /version takes the shared secret.
"""
