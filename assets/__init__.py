"""Data files of ShardScope: presets, icons, style sheet. No code lives here."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
PRESETS_DIR = ASSETS_DIR / "presets"
HF_CONFIGS_DIR = ASSETS_DIR / "hf_configs"  # <name>/config.json: public Hugging Face configs of the presets
