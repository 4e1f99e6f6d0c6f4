"""`grpo serve`: a generation server that trainers send prompts to and stream weights to.

    GRPO_SERVE_API_KEY=secret grpo serve examples/tiny.yaml --engine hf --port 8000
    GRPO_SERVE_API_KEY=secret grpo serve Qwen/Qwen3-0.6B --engine vllm --tensor-parallel-size 4

`--engine vllm` (grpo.serve.vllm) runs vLLM's own OpenAI-compatible server with its weight-transfer
routes on: NCCL on CUDA, and on CPUs the gloo engine grpo registers in vLLM (grpo.serve.vllm_gloo,
through grpo.serve.vllm_plugin), every route but /health and /version behind the shared secret
(grpo.serve.vllm_secret). `--engine hf` (grpo.serve.hf) serves grpo's own `hf` engine, built as a
trainer builds it for the same model config (its device layer and decoding included), behind the
endpoints of vLLM's OpenAI-compatible server and its weight-transfer routes. The `server` rollout
engine (grpo.rollout.server) speaks to both. Each binds to 127.0.0.1 unless told otherwise.
"""
