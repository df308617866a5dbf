"""The model room: what a model is and how its parameters fall on ranks.

``params`` (parameter counts per block, rank and stage), ``family`` (a preset's family and its sizes),
``presets`` (the shipped model and GPU presets), ``hf_config`` (reading a Hugging Face config.json),
``lora`` (LoRA adapters) and ``recompute`` (what each recompute policy keeps of a block).
"""
