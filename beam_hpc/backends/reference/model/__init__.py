"""The model side, shared by the trainer and every rollout worker: the causal LM, sampling, LoRA,
the chat tokenizer, the policy loader, and the tiny and SmolLM2 models the recipes name. It
imports nothing else of the backend."""
