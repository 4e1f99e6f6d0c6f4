"""The decoding copy of the policy (grpo.cuda.weights.DecodingCopy), built and refreshed on the CPU
as on CUDA: its weights are the policy's in the decoding dtype, LoRA merged in; a refresh after
the policy changed rewrites them in place (a captured graph reads fixed addresses); the policy
itself is never touched."""

import torch

from grpo.cuda.weights import DecodingCopy, unsupported_reason
from grpo.models import lora


def _step(model, scale=0.01):
    """What an optimizer step does to the trainable parameters: changes them in place."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)


def test_a_bf16_copy_is_the_policy_cast_and_follows_it_in_place(tiny):
    policy = tiny("qwen2")  # tied embeddings: one tensor in the copy too
    copies = DecodingCopy()
    copy = copies.refreshed(policy, torch.bfloat16)
    assert copy is not policy and not copy.training
    for (name, p), (_, q) in zip(policy.named_parameters(), copy.named_parameters(), strict=True):
        assert q.dtype == torch.bfloat16 and not q.requires_grad, name
        assert torch.equal(q, p.to(torch.bfloat16)), name
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    # the rotary frequencies stay as the policy computed them (float32)
    assert copy.model.rotary_emb.inv_freq.dtype == policy.model.rotary_emb.inv_freq.dtype
    addresses = [q.data_ptr() for q in copy.parameters()]
    _step(policy)
    again = copies.refreshed(policy, torch.bfloat16)
    assert again is copy and [q.data_ptr() for q in again.parameters()] == addresses
    for p, q in zip(policy.parameters(), again.parameters()):
        assert torch.equal(q, p.to(torch.bfloat16))


def test_a_copy_in_the_policys_own_dtype_shares_its_weights(tiny):
    policy = tiny("llama")
    copy = DecodingCopy().refreshed(policy, torch.float32)
    assert copy is not policy  # its own module, in eval mode whatever the policy's
    assert all(p is q for p, q in zip(policy.parameters(), copy.parameters(), strict=True))
    policy.train()
    assert not copy.training and all(p.requires_grad for p in policy.parameters())


def test_with_lora_the_copy_holds_the_merged_weights_and_no_adapter(tiny):
    policy = tiny("gemma3", with_lora=True)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    copies = DecodingCopy()
    copy = copies.refreshed(policy, torch.float32)
    assert lora.lora_layers(copy) == [] and lora.peft_model(copy) is None
    assert policy.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    q_proj = policy.model.layers[0].self_attn.q_proj
    merged, _ = lora.merged_linear(q_proj)
    assert not torch.equal(merged, q_proj.base_layer.weight)  # the adapter counts
    assert torch.equal(copy.model.layers[0].self_attn.q_proj.weight, merged)
    # the merged model computes what the adapted one does
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(copy(ids).logits, policy(ids).logits, rtol=1e-5, atol=1e-5)
    _step(policy, scale=0.1)  # only the adapter trains
    copies.refreshed(policy, torch.float32)
    assert torch.equal(copy.model.layers[0].self_attn.q_proj.weight, lora.merged_linear(q_proj)[0])


def test_what_cannot_be_copied_is_named(tiny):
    policy = tiny("llama")
    assert unsupported_reason(policy) is None
    policy.hf_quantizer = object()
    assert "quantized base" in unsupported_reason(policy)
