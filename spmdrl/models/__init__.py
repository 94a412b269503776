"""Hugging Face model directories as spmdrl reads them, without building an engine: a model's config and its
parameters' names and shapes (model.py), the checkpoint's safetensors files and the names and views they store
tensors under (checkpoint.py), and LoRA adapters as PEFT names and files them (lora.py). The engines, the weight
sync, the rollout engines and the config checks all read these, so the package sits below them."""
