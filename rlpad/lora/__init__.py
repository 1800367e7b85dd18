"""LoRA: the rules, torch-free (rules.py: targets, the ranks vLLM serves, sync modes, config checks,
adapter parameter names) and the peft side (adapters.py: adapters on a model, the merge, the
adapter folder). docs/lora.md."""
