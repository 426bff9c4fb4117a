"""LoRA adapters applied per row on top of one base model (docs/running.md, "LoRA adapters")."""
