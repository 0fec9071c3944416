"""Adapters in and out of the Hugging Face stack, and merged-model export.

- `to_peft.export_peft`: adapter checkpoint -> PEFT LoRA (per-expert layout), streamed, lossless.
- `from_peft.import_peft`: PEFT LoRA (per-expert or transformers-5 fused layout) -> adapter
  checkpoint loadable at any layout.
- `merged.export_merged_hf`: base torch_dist checkpoint + adapter -> merged HF safetensors.
- `table`: where each factor lives on both sides (derived from `convert.mapping`).
See docs/peft.md.
"""
