"""Adapters over a frozen base: peft's LoRA (``lora``), the 4-bit base (``quant``) and its partitioned load under
ZeRO-3 (``partitioned_load``), the exporters (``exporters``: which one a run gets, and the streamed one) with the
merge into the 16-bit base read again from its files shard by shard (``merge``) and the in-memory merge of a base
without files (``lora_export``), the logit round trip both exports are judged by, token by token (``logit_check``),
and peft's MoE target rewrite switched off (``peft_compat``). The engines call ``lora.apply_lora``, ``quant.prepare``
and ``exporters.lora_exporter``; nothing else reaches in."""
