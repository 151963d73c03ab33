"""Adapters over a frozen base: peft's LoRA (``lora``; its merged export ``lora_export``), the 4-bit base (``quant``)
and its partitioned load under ZeRO-3 (``partitioned_load``), the export that merges the adapters into the 16-bit base
shard by shard (``merge``), the logit round trip both exports are judged by, token by token (``logit_check``), and
peft's MoE target rewrite switched off (``peft_compat``). The engines call ``lora.apply_lora``, ``quant.prepare`` and
the exporters; nothing else reaches in."""
