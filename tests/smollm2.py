"""The default model's reference prompts: the greedy continuations of these, NEW_TOKENS long, are what
the engine is compared on against Hugging Face (test_smollm2_reference) and in bf16 (test_bf16_parity)."""

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 16
