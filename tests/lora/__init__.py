"""LoRA, QLoRA and DoRA layers, dropout, AdamW and PEFT adapter files (nybble.lora), and the
adapter fuzz suite."""
