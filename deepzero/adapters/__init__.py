"""Adapters over a frozen base: peft's LoRA (``lora``), the 4-bit base (``quant``) and its partitioned load under
ZeRO-3 (``partitioned_load``), and the export that merges the adapters into the 16-bit base shard by shard
(``merge``). The engines call ``lora.apply_lora``, ``quant.prepare`` and the exporters; nothing else reaches in."""
