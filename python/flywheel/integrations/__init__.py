"""flywheel inside other frameworks: `flywheel.integrations.transformers` (Hugging Face
transformers' attention registry and its Qwen3-Next / Qwen3.5 Gated DeltaNet layers)."""
